"""The frontend <-> worker wire format (``syncd.engine.dynamo.protocol``): pure functions, no processes."""

from __future__ import annotations

import pytest

from syncd.engines.protocol import TokenEvent
from syncd.engine.dynamo.protocol import (BadRequest, UnsupportedRequest, seed_for, to_chunk, to_generation_request,
                                    wants_logprobs)


def _req(**over):
    req = {"token_ids": [5, 6, 7],
           "stop_conditions": {"max_tokens": 9, "stop_token_ids": [11], "stop_token_ids_hidden": [2],
                               "ignore_eos": None, "min_tokens": None},
           "sampling_options": {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 123},
           "eos_token_ids": [2], "output_options": {"logprobs": None}}
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(req.get(k), dict):
            req[k] = {**req[k], **v}
        else:
            req[k] = v
    return req


def test_fields_map_to_the_engine_request():
    g = to_generation_request(_req(), "rid-1")
    assert g.request_id == "rid-1" and g.prompt_token_ids == (5, 6, 7)
    sp = g.sampling
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.seed) == (9, 0.7, 0.9, 40, 123)
    assert sp.stop_token_ids == (2, 11)  # the hidden EOS stops too


def test_defaults_ignore_eos_and_derived_seed():
    g = to_generation_request(_req(stop_conditions={"max_tokens": None, "ignore_eos": True},
                                   sampling_options={"temperature": None, "top_p": None, "top_k": -1, "seed": None}),
                              "rid-2", default_max_tokens=77)
    sp = g.sampling
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.top_k) == (77, 1.0, 1.0, 0)
    assert sp.stop_token_ids == (11,)  # EOS dropped by ignore_eos, explicit stop ids kept
    # no seed: derived from the request id, so a migrated request (same id) draws the same numbers
    assert sp.seed == seed_for("rid-2") == to_generation_request(_req(sampling_options={"seed": None}), "rid-2").sampling.seed
    assert seed_for("rid-2") != seed_for("rid-3") and 0 <= seed_for("x") < 2 ** 63


@pytest.mark.parametrize("over, what", [
    ({"sampling_options": {"n": 2}}, "n=2"),
    ({"sampling_options": {"presence_penalty": 0.5}}, "presence_penalty"),
    ({"sampling_options": {"repetition_penalty": 1.2}}, "repetition_penalty"),
    ({"sampling_options": {"use_beam_search": True}}, "use_beam_search"),
    ({"sampling_options": {"guided_decoding": {"json": {}}}}, r"guided_decoding=\{'json': \{\}\} \(asked for by response_format"),
    ({"stop_conditions": {"min_tokens": 4}}, "min_tokens"),
    ({"output_options": {"logprobs": 3}}, r"top_logprobs=3 \(completions: logprobs=3"),
])
def test_options_the_engine_cannot_honour_are_refused(over, what):
    with pytest.raises(UnsupportedRequest, match=what):
        to_generation_request(_req(**over), "r")


@pytest.mark.parametrize("over, what", [
    ({"token_ids": []}, "non-empty"),
    ({"token_ids": [1, "2"]}, "integers"),
    ({"token_ids": [1, True]}, "integers"),
    ({"stop_conditions": {"max_tokens": 0}}, "at least 1"),
    ({"stop_conditions": {"max_tokens": "many"}}, "number"),
    ({"sampling_options": {"temperature": float("nan")}}, "finite"),
    ({"sampling_options": {"top_p": 0}}, "top_p"),
    ({"stop_conditions": {"stop_token_ids": "3"}}, "list of integers"),
])
def test_malformed_requests_say_what_is_wrong(over, what):
    with pytest.raises(BadRequest, match=what):
        to_generation_request(_req(**over), "r")
    with pytest.raises(BadRequest, match="JSON object"):
        to_generation_request(["not", "a", "dict"], "r")


def test_chunks_carry_token_version_and_finish():
    ev = TokenEvent("rid", 4, 42, -1.5, 7, None)
    c = to_chunk(ev)
    assert c == {"token_ids": [42], "engine_data": {"syncd": 1, "request_id": "rid", "index": 4, "token_ids": [42],
                                                   "versions": [7], "logprobs": [-1.5]}}
    last = to_chunk(TokenEvent("rid", 5, 2, float("-inf"), None, "stop"), logprobs=True)
    assert last["finish_reason"] == "stop" and last["engine_data"]["versions"] == [None]
    assert last["log_probs"] == last["engine_data"]["logprobs"] and last["log_probs"][0] < -1e38  # JSON-safe
    assert to_chunk(TokenEvent("rid", 5, 2, 0.0, 1, "length"))["finish_reason"] == "length"
    with pytest.raises(ValueError, match="abort"):
        to_chunk(TokenEvent("rid", 5, -1, 0.0, 1, "abort"))
    assert wants_logprobs({"output_options": {"logprobs": 2}}) and not wants_logprobs({"output_options": {}})


def test_one_logprob_per_token_is_what_the_engine_reports():
    """Chat ``logprobs=True`` and ``top_logprobs=1`` reach the worker as logprobs 1, completions ``logprobs=N`` as N:
    1 or less is served (the sampled token's), more is refused above."""
    for n in (None, 0, 1, False, True):
        to_generation_request(_req(output_options={"logprobs": n}), "r")
