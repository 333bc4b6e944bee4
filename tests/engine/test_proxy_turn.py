"""``syncd.engine.proxy.turn``: what the frontend sends is checked before it enters a record -- a malformed or
non-strict event, ``engine_data`` or choice fails the turn with the reason, never a record that cannot be
encoded or read back."""

from __future__ import annotations

import json

import pytest

from syncd.engine.proxy.record import Turn
from syncd.engine.proxy.sse import format_event
from syncd.engine.proxy.turn import (BadRequest, Broken, TurnState, annotation_ids, client_wants, parse_body, parse_event,
                               upstream_body)


def _state() -> TurnState:
    return TurnState(Turn(0, "completions", {}, True))


@pytest.mark.parametrize("data, why", [
    ('{"choices": [], "x": NaN}', "NaN is not a JSON value"),
    ("[" * 100 + "]" * 100, "nested deeper than 64"),
    ("[1]", "not a JSON object"),
    ('{"usage": [1]}', "malformed usage"),
])
def test_malformed_upstream_events_break_the_turn(data, why):
    with pytest.raises(Broken, match=why):
        parse_event(data)


@pytest.mark.parametrize("ed", [
    {"syncd": 1, "token_ids": ["5"], "versions": [0], "logprobs": [-0.1], "request_id": "r", "index": 0},
    {"syncd": 1, "token_ids": [5], "versions": ["0"], "logprobs": [-0.1], "request_id": "r", "index": 0},
    {"syncd": 1, "token_ids": [5], "versions": [0], "logprobs": [float("-inf")], "request_id": "r", "index": 0},
    {"syncd": 1, "token_ids": [5], "versions": [0], "logprobs": [-0.1], "request_id": "r", "index": True},
])
def test_engine_data_the_record_could_not_hold_is_refused(ed):
    st = _state()
    with pytest.raises(Broken, match="malformed engine_data"):
        st.add_engine_data(ed)
    assert st.turn.output_token_ids == [] and st.turn.versions == []
    st.add_engine_data({**ed, "token_ids": [5], "versions": [None], "logprobs": [-0.5], "index": 0})
    assert st.turn.output_token_ids == [5] and json.dumps(st.turn.to_json(), allow_nan=False)


def test_malformed_choices_and_annotations():
    st = _state()
    with pytest.raises(Broken, match="malformed choices"):
        st.add_choices({"choices": [{"index": 0, "text": 5}]}, chat=False)
    with pytest.raises(Broken, match="malformed choices"):
        st.add_choices({"choices": [{"delta": {"tool_calls": [{"function": {"name": 1}}]}}]}, chat=True)
    st.add_choices({"choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]}, chat=False)
    assert st.turn.text == "ok" and st.turn.finish_reason == "length"
    assert annotation_ids('"[1,2]"') == [1, 2]
    with pytest.raises(Broken, match="token_ids"):
        annotation_ids("[[[1]]]")


def test_bodies_and_a_lone_surrogate():
    assert parse_body(b'{"prompt": "\\ud800"}', max_bytes=100) == {"prompt": "\ud800"}
    with pytest.raises(BadRequest, match="'nvext.annotations' must be a list of strings"):
        parse_body(b'{"nvext": {"annotations": "token_ids"}}', max_bytes=100)
    # a lone surrogate is valid in a JSON escape but not in UTF-8: the event carries the escape
    assert format_event({"text": "\ud800"}) == b'data: {"text":"\\ud800"}\n\n'


def test_a_whole_chat_response_folds_tool_calls_logprobs_and_finish_reason():
    """What a non-streamed client gets is the frontend's aggregate of the stream: tool-call fragments joined per
    index, log-prob entries concatenated, the finish reason, ``refusal`` null. (The tiny random model never
    calls a tool, so the end-to-end test cannot show tool calls; this folds OpenAI-shaped chunks.)"""
    from syncd.engine.proxy.turn import whole_response

    st = TurnState(Turn(0, "chat/completions", {}, False))
    def lp(tok, x):
        return {"content": [{"token": tok, "logprob": x, "top_logprobs": [{"token": tok, "logprob": x}]}],
                "refusal": None}
    chunks = [
        {"index": 0, "delta": {"role": "assistant", "content": None}, "logprobs": lp("a", -0.5)},
        {"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                               "function": {"name": "get_", "arguments": '{"ci'}}]},
         "logprobs": lp("b", -0.25)},
        {"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"name": "weather", "arguments": 'ty": 1}'}}]},
         "logprobs": lp("c", -1.0), "finish_reason": "tool_calls"},
    ]
    for ch in chunks:
        st.add_choices({"choices": [ch]}, chat=True)
    st.last = {"model": "m", "created": 1}
    out = whole_response(st, "chat/completions")
    (choice,) = out["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"] == {"role": "assistant", "content": "", "refusal": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": 1}'}}]}
    assert [e["token"] for e in choice["logprobs"]["content"]] == ["a", "b", "c"]
    assert choice["logprobs"]["refusal"] is None and "system_fingerprint" not in out


def test_completions_logprobs_fold_and_empty_chunks_are_dropped():
    from syncd.engine.proxy.turn import for_client, whole_response

    st = TurnState(Turn(0, "completions", {}, False))
    for i, (tok, x) in enumerate([("x", -1.0), ("y", -2.0)]):
        st.add_choices({"choices": [{"index": 0, "text": tok, "logprobs": {
            "tokens": [tok], "token_logprobs": [x], "top_logprobs": [{tok: x}], "text_offset": [i]}}]}, chat=False)
    st.last = {"system_fingerprint": None}
    out = whole_response(st, "completions")
    assert out["choices"][0]["logprobs"] == {"tokens": ["x", "y"], "token_logprobs": [-1.0, -2.0],
                                             "top_logprobs": [{"x": -1.0}, {"y": -2.0}], "text_offset": [0, 1]}
    assert out["choices"][0]["text"] == "xy" and out["system_fingerprint"] is None
    ed = {"nvext": {"engine_data": {"syncd": 1}}}
    # a chunk the frontend sent only because the proxy asked for engine_data: nothing for the client
    assert for_client({"choices": [{"index": 0, "delta": {"content": None, "role": None}}], **ed}, set()) is None
    assert for_client({"choices": [{"index": 0, "text": ""}], **ed}, set()) is None
    # a role, a finish reason, log-probs or a client that asked for engine_data: sent
    assert for_client({"choices": [{"index": 0, "delta": {"role": "assistant"}}], **ed}, set()) is not None
    assert for_client({"choices": [{"index": 0, "text": "", "finish_reason": "length"}], **ed}, set()) is not None
    assert for_client({"choices": [{"index": 0, "text": "", "logprobs": {"tokens": []}}], **ed}, set()) is not None
    assert for_client({"choices": [{"index": 0, "text": ""}], **ed}, {"engine_data"})["nvext"] == ed["nvext"]


@pytest.mark.parametrize("body, field", [
    ({"nvext": []}, "'nvext' must be a JSON object"),
    ({"nvext": "x"}, "'nvext' must be a JSON object"),
    ({"stream_options": "x"}, "'stream_options' must be a JSON object"),
    ({"stream_options": [1]}, "'stream_options' must be a JSON object"),
    ({"nvext": {"extra_fields": [[1]]}}, "'nvext.extra_fields' must be a list of strings"),
    ({"nvext": {"extra_fields": "engine_data"}}, "'nvext.extra_fields' must be a list of strings"),
    ({"nvext": {"annotations": [1, "a"]}}, "'nvext.annotations' must be a list of strings"),
])
def test_malformed_nvext_and_stream_options_are_refused_naming_the_field(body, field):
    """Refused by ``parse_body``, before any turn is opened; what it lets through ``upstream_body`` and
    ``client_wants`` (the one parse compaction uses too) take without raising."""
    with pytest.raises(BadRequest, match=field):
        parse_body(json.dumps(body).encode(), max_bytes=1000)
    ok = parse_body(b'{"nvext": {"extra_fields": ["x"], "annotations": []}, "stream_options": {}}', max_bytes=1000)
    assert upstream_body(ok)["nvext"]["extra_fields"] == ["engine_data", "x"]
    assert client_wants(ok) == ({"x"}, False, False)
