"""The wire format between the Dynamo frontend and an ``syncd.engines.Generator`` worker, both ways. Pure functions.

Requests (what the frontend sends a ``ModelInput.Tokens`` worker, one JSON object per request)::

    {"token_ids": [...],                                   # the prompt; after a migration it also holds
                                                           # the tokens generated so far
     "stop_conditions": {"max_tokens", "stop_token_ids", "stop_token_ids_hidden", "ignore_eos", "min_tokens"},
     "sampling_options": {"temperature", "top_p", "top_k", "seed", "n", "best_of", ...penalties},
     "output_options": {"logprobs", ...}, "eos_token_ids": [...], ...}

:func:`to_generation_request` turns one into an :class:`syncd.engines.GenerationRequest`. Options the
``syncd.engines.SamplingParams`` contract cannot honour (``n > 1``, beam search, penalties, ``min_p``, guided
decoding, ``min_tokens``) raise :class:`UnsupportedRequest` rather than being ignored, and so does a request for
more than one log-probability per token (``output_options.logprobs`` above 1: a chat ``top_logprobs`` of 2 or more,
a completions ``logprobs`` of 2 or more): an engine reports the sampled token's log-probability alone, and the
frontend would otherwise answer with one entry where the client asked for several. Without a ``seed`` the
seed is derived from the request id, which Dynamo keeps when it migrates a request: the continuation on
another worker then draws the same random numbers as an undisturbed run would have.

Responses: :func:`to_chunk` turns one :class:`syncd.engines.TokenEvent` into an output chunk::

    {"token_ids": [t], "finish_reason": ... (last chunk only), "log_probs": [lp] (when asked),
     "engine_data": {"syncd": 1, "request_id": engine request id, "index": i, "token_ids": [t],
                     "versions": [weight version], "logprobs": [lp]}}

``engine_data`` reaches an OpenAI client as ``nvext.engine_data`` of each streamed chunk when the request
asks for it (``"nvext": {"extra_fields": ["engine_data"]}``); ``syncd.engine.proxy`` relies on it to record token
ids and the weight version of every token.
"""

from __future__ import annotations

import hashlib
import math
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:  # imported where used: the engine contract imports torch, and `--help` must not wait for it
    from syncd.engines.protocol import GenerationRequest, TokenEvent

__all__ = ["UnsupportedRequest", "BadRequest", "to_generation_request", "to_chunk", "seed_for",
           "ENGINE_DATA_SCHEMA", "DEFAULT_MAX_TOKENS"]

ENGINE_DATA_SCHEMA = 1
DEFAULT_MAX_TOKENS = 1024
_ENGINE_FINISH = {"stop": "stop", "length": "length"}


class BadRequest(ValueError):
    """A worker request that is malformed (missing or mistyped member)."""


class UnsupportedRequest(ValueError):
    """A request asking for something the engine contract cannot do (e.g. ``n > 1``, penalties)."""


def seed_for(request_id: str) -> int:
    """A 63-bit seed derived from ``request_id`` (stable across processes and migrations)."""
    return int.from_bytes(hashlib.sha256(request_id.encode("utf-8")).digest()[:8], "little") >> 1


def _opt(d: Mapping[str, Any], key: str):
    v = d.get(key)
    return None if v is None else v


def _number(v, what: str, cast):
    try:
        x = cast(v)
    except (TypeError, ValueError):
        raise BadRequest(f"{what} must be a number, got {v!r}") from None
    if isinstance(x, float) and not math.isfinite(x):
        raise BadRequest(f"{what} must be finite, got {v!r}")
    return x


def _token_list(v, what: str) -> tuple[int, ...]:
    if v is None:
        return ()
    if not isinstance(v, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise BadRequest(f"{what} must be a list of integers")
    return tuple(v)


#: what a client calls an option whose name the frontend changed on its way to the worker
_CLIENT_NAMES = {"guided_decoding": " (asked for by response_format, text.format or a guided_* option)"}


def _check_unsupported(sampling: Mapping[str, Any], stop: Mapping[str, Any], output: Mapping[str, Any]) -> None:
    problems = []
    wanted = output.get("logprobs")
    if isinstance(wanted, int) and not isinstance(wanted, bool) and wanted > 1:
        problems.append(f"top_logprobs={wanted} (completions: logprobs={wanted}; it reports the sampled token's "
                        "log-probability only, top_logprobs 1 at most)")
    for key, neutral in (("n", (None, 1)), ("best_of", (None, 1)), ("use_beam_search", (None, False)),
                         ("presence_penalty", (None, 0, 0.0)), ("frequency_penalty", (None, 0, 0.0)),
                         ("repetition_penalty", (None, 1, 1.0)), ("min_p", (None, 0, 0.0)),
                         ("guided_decoding", (None,)), ("length_penalty", (None, 1, 1.0))):
        if sampling.get(key) not in neutral:
            problems.append(f"{key}={sampling.get(key)!r}{_CLIENT_NAMES.get(key, '')}")
    if stop.get("min_tokens") not in (None, 0):
        problems.append(f"min_tokens={stop.get('min_tokens')!r}")
    if problems:
        raise UnsupportedRequest("this engine does not support " + ", ".join(problems))


def to_generation_request(request: Mapping[str, Any], request_id: str, *,
                          default_max_tokens: int = DEFAULT_MAX_TOKENS) -> GenerationRequest:
    """The :class:`GenerationRequest` for one frontend request (see the module docstring).

    ``request_id``: the engine-side id (the Dynamo request id). Stop tokens are ``stop_token_ids`` plus the
    hidden ones (the model's EOS), minus ``eos_token_ids`` when ``ignore_eos`` is set. ``max_tokens``
    missing: ``default_max_tokens``. Raises :class:`BadRequest` / :class:`UnsupportedRequest`."""
    from syncd.engines.protocol import GenerationRequest, SamplingParams

    if not isinstance(request, Mapping):
        raise BadRequest(f"request must be a JSON object, got {type(request).__name__}")
    prompt = _token_list(request.get("token_ids"), "token_ids")
    if not prompt:
        raise BadRequest("token_ids (the prompt) must be a non-empty list of integers")
    stop = request.get("stop_conditions") or {}
    sampling = request.get("sampling_options") or {}
    output = request.get("output_options") or {}
    if not isinstance(stop, Mapping) or not isinstance(sampling, Mapping) or not isinstance(output, Mapping):
        raise BadRequest("stop_conditions, sampling_options and output_options must be JSON objects")
    _check_unsupported(sampling, stop, output)

    max_tokens = stop.get("max_tokens")
    max_tokens = default_max_tokens if max_tokens is None else _number(max_tokens, "max_tokens", int)
    if max_tokens < 1:
        raise BadRequest(f"max_tokens must be at least 1, got {max_tokens}")
    stop_ids = set(_token_list(stop.get("stop_token_ids"), "stop_token_ids"))
    stop_ids |= set(_token_list(stop.get("stop_token_ids_visible"), "stop_token_ids_visible"))
    hidden = set(_token_list(stop.get("stop_token_ids_hidden"), "stop_token_ids_hidden"))
    if stop.get("ignore_eos"):
        hidden -= set(_token_list(request.get("eos_token_ids"), "eos_token_ids"))
    stop_ids |= hidden

    temperature = _opt(sampling, "temperature")
    top_p = _opt(sampling, "top_p")
    top_k = _opt(sampling, "top_k")
    seed = _opt(sampling, "seed")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if temperature is None else _number(temperature, "temperature", float),
        top_p=1.0 if top_p is None else _number(top_p, "top_p", float),
        top_k=0 if top_k in (None, -1) else _number(top_k, "top_k", int),
        seed=seed_for(request_id) if seed is None else _number(seed, "seed", int),
        stop_token_ids=tuple(sorted(stop_ids)),
    )
    if params.temperature < 0 or not 0 < params.top_p <= 1 or params.top_k < 0:
        raise BadRequest(f"need temperature >= 0, 0 < top_p <= 1, top_k >= 0 (got {params.temperature}, "
                         f"{params.top_p}, {params.top_k})")
    return GenerationRequest(request_id, prompt, params)


def nothing_left(request: Mapping[str, Any]) -> bool:
    """Whether ``request`` asks for no more tokens (``max_tokens`` 0). The frontend refuses ``max_tokens`` 0
    from clients ("Max tokens must be greater than 0"), so it reaches a worker only as a migration whose
    subtraction left nothing: the dead worker had streamed every token but not the end of its stream. The
    worker then ends the request at once (:func:`final_chunk`) instead of refusing it."""
    if not isinstance(request, Mapping):
        return False
    stop, prompt = request.get("stop_conditions"), request.get("token_ids")
    return (isinstance(stop, Mapping) and _is_zero(stop.get("max_tokens")) and isinstance(prompt, list)
            and len(prompt) > 0)


def _is_zero(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v == 0


def final_chunk(request_id: str) -> dict:
    """The chunk that ends a request without a token (``finish_reason`` ``"length"``: its budget is spent)."""
    return {"token_ids": [], "finish_reason": "length",
            "engine_data": {"syncd": ENGINE_DATA_SCHEMA, "request_id": request_id, "index": 0, "token_ids": [],
                            "versions": [], "logprobs": []}}


def wants_logprobs(request: Mapping[str, Any]) -> bool:
    """Whether the client asked for per-token log-probabilities."""
    out = request.get("output_options") or {}
    return isinstance(out, Mapping) and out.get("logprobs") not in (None, False, 0)


def to_chunk(event: TokenEvent, *, logprobs: bool = False) -> dict:
    """The output chunk for one generated token (``event.finish_reason`` ``"stop"``/``"length"``/None).

    An ``"abort"`` event is not a token: callers handle it (see ``syncd.engine.dynamo.worker``)."""
    if event.finish_reason == "abort":
        raise ValueError("an abort event carries no token")
    chunk: dict = {
        "token_ids": [event.token_id],
        "engine_data": {"syncd": ENGINE_DATA_SCHEMA, "request_id": event.request_id, "index": event.index,
                        "token_ids": [event.token_id], "versions": [event.version],
                        "logprobs": [_finite(event.logprob)]},
    }
    if logprobs:
        chunk["log_probs"] = [_finite(event.logprob)]
    if event.finish_reason is not None:
        chunk["finish_reason"] = _ENGINE_FINISH.get(event.finish_reason, event.finish_reason)
    return chunk


def _finite(x: float) -> float:
    """JSON has no -inf: a token sampled with probability 0 (never, in practice) reports the float32 floor."""
    return x if math.isfinite(x) else -3.4028234663852886e38
