"""``POST /v1/responses`` through the proxy: the OpenAI Responses API, sent to the frontend as the client sent it and
answered as the frontend answered (streamed events passed on one by one, a whole response byte for byte), each
call recorded as a turn of its trajectory (``"endpoint": "responses"``). ``syncd.engine.proxy.server`` runs the
turn and its retries, as for a completion.

What the record holds: the client's request, the response id, the output text (the ``output_text`` parts of its
messages), the frontend's ``usage`` (``input_tokens``, ``output_tokens``) and a finish reason (``"stop"``,
``"tool_calls"``, ``"length"`` for ``max_output_tokens``, else the frontend's reason). What it cannot hold:
Dynamo 1.6's frontend sends no ``nvext`` on this route (neither ``engine_data`` per token nor the prompt's
``token_ids``: a whole response carries the last token's ``engine_data`` only), so the prompt and output token
ids, their weight versions and log-probabilities are unknown, and the turn is marked failed with that reason
(the client still gets its response): a trajectory is ``complete`` only when its token record is whole, and the
trainer cannot train on text. An agent whose rollouts are to be trained on uses ``/v1/chat/completions``.

Retries: only while nothing went to the client (a stream's first event is passed on at once): no connection,
HTTP 5xx/408/429, a 404 while the frontend lists no model (``syncd.engine.proxy.upstream``). The frontend's
answer to the client's mistake (HTTP 4xx; a ``response.failed`` event on a stream) is passed on as it came.

Thread-safety: none; used from the proxy's one asyncio loop.
"""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from syncd.engine.proxy import sse
from syncd.engine.proxy.turn import Broken, ClientStream, Retryable, TurnState, parse_event
from syncd.engine.proxy.upstream import read_head, refusal, refused_on_stream

__all__ = ["respond_once", "finish", "ENDPOINT", "MAX_RESPONSE_BYTES"]

ENDPOINT = "responses"
MAX_RESPONSE_BYTES = 64 << 20  # of a whole (non-streamed) response
#: stream events that carry the final response object
_FINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})


async def respond_once(session, upstream: str, state: TurnState, up_body: dict, endpoint: str,
                       out: ClientStream) -> None:
    """One attempt at a Responses call (the signature of ``syncd.engine.proxy.upstream.stream_once``): send
    ``up_body`` to ``upstream``'s ``/v1/responses``, pass its answer on through ``out`` (a whole one is kept in
    ``state.body`` for :func:`finish`) and record what it says into ``state.turn``. Raises :class:`Retryable`
    while nothing went to the client, :class:`Broken` after, :class:`Rejected`, ``ClientGone``."""
    turn = state.turn
    try:
        async with session.post(f"{upstream}/v1/{ENDPOINT}", json=up_body) as resp:
            if resp.status != 200:
                raise await refusal(session, upstream, resp)
            if resp.content_type != "text/event-stream":
                raw = await read_head(resp.content, MAX_RESPONSE_BYTES + 1)
                if len(raw) > MAX_RESPONSE_BYTES:
                    raise Broken(f"the upstream response is over {MAX_RESPONSE_BYTES} bytes")
                _record(turn, _parse(raw.decode("utf-8", errors="replace"), out))
                state.body = raw
                return
            final = None
            async for event, data in sse.events(resp.content.iter_any()):
                if event == "message" and data.strip() == "[DONE]":
                    break
                obj = _parse(data, out)
                refused = refused_on_stream(obj) if out.response is None else None
                if refused is not None:
                    raise refused
                if event in _FINAL_EVENTS or obj.get("type") in _FINAL_EVENTS:
                    final = obj.get("response")
                await out.send(sse.format_event(data, None if event == "message" else event))
            if not isinstance(final, dict):
                raise _failure(out, "the upstream stream ended without the final response event")
            _record(turn, final)
    except (aiohttp.ClientError, asyncio.TimeoutError, sse.SSEError, ConnectionError) as exc:
        raise _failure(out, f"{type(exc).__name__}: {exc}") from None


async def finish(state: TurnState, out: ClientStream) -> web.StreamResponse:
    """End a Responses turn whose attempt succeeded: mark it failed for its missing token record (unless it
    failed already, e.g. the frontend's ``response.failed``) and give the client the rest of its answer."""
    turn = state.turn
    if turn.status != "failed":
        n = (turn.usage or {}).get("output_tokens")
        turn.fail(f"no token record: the frontend's /v1/{ENDPOINT} sends no per-token engine_data, so the "
                  f"{n if n is not None else 'unknown number of'} output tokens (ids, weight versions, "
                  "log-probabilities) are not recorded; the text and usage are")
    if state.body is None:  # a stream: its events went out as they came
        return await out.end()
    return web.Response(status=200, body=state.body, content_type="application/json", headers=out.headers)


def _parse(data: str, out: ClientStream) -> dict:
    try:
        return parse_event(data)
    except Broken as exc:
        raise _failure(out, f"upstream sent a malformed event: {exc}") from None


def _failure(out: ClientStream, reason: str) -> Exception:
    return Retryable(reason) if out.response is None else Broken(reason)


def _record(turn, final) -> None:
    """Fold the final response object into the turn (see the module docstring); a failed one fails the turn."""
    if not isinstance(final, dict):
        raise Broken(f"the upstream's final response is not a JSON object: {str(final)[:200]}")
    turn.response_id = final.get("id") if isinstance(final.get("id"), str) else None
    turn.usage = final.get("usage") if isinstance(final.get("usage"), dict) else None
    items = [i for i in _list(final.get("output")) if isinstance(i, dict)]
    parts = [p for i in items if i.get("type") == "message" for p in _list(i.get("content")) if isinstance(p, dict)]
    turn.text = "".join(p["text"] for p in parts if p.get("type") == "output_text" and isinstance(p.get("text"), str))
    status = final.get("status")
    if status == "completed":
        turn.finish_reason = "tool_calls" if any(i.get("type") == "function_call" for i in items) else "stop"
    elif status == "incomplete":
        details = final.get("incomplete_details")
        reason = details.get("reason") if isinstance(details, dict) else None
        turn.finish_reason = "length" if reason == "max_output_tokens" else str(reason or "incomplete")
    else:
        err = final.get("error") if isinstance(final.get("error"), dict) else {}
        turn.fail(f"the frontend's response {status or 'without a status'}: {str(err.get('message') or err)[:500]}")


def _list(v) -> list:
    return v if isinstance(v, list) else []
