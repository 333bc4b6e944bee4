"""One attempt at a turn against the Dynamo frontend (``syncd.engine.proxy.server`` retries it): the SSE stream of a
completion, parsed strictly, recorded into the turn, and passed on to the client as it asked for it."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from syncd.engine.proxy import sse
from syncd.engine.proxy.turn import (Broken, ClientStream, Rejected, Retryable, TurnState, annotation_ids, client_wants,
                               for_client, parse_event)

__all__ = ["stream_once", "RETRYABLE_STATUS", "MAX_ERROR_BODY_BYTES"]

RETRYABLE_STATUS = frozenset({404, 408, 429, 500, 502, 503, 504})
MAX_ERROR_BODY_BYTES = 4096  # of a non-200 reply: what goes into the retry log, the turn's error and the record


async def stream_once(session, upstream: str, state: TurnState, up_body: dict, endpoint: str,
                      out: ClientStream) -> None:
    """One attempt at a turn: stream ``up_body`` from the frontend at ``upstream`` (``/v1/<endpoint>``) into
    ``state``, passing the client what it asked for through ``out``. Raises :class:`Retryable` while no token
    came back, :class:`Broken` after, :class:`Rejected` for a status not worth a retry, ``ClientGone``. Of a
    non-200 reply at most :data:`MAX_ERROR_BODY_BYTES` are read (the rest is dropped with the connection)."""
    turn = state.turn
    wants_fields, wants_ids, wants_usage = client_wants(turn.request)
    chat = endpoint == "chat/completions"
    try:
        async with session.post(f"{upstream}/v1/{endpoint}", json=up_body) as resp:
            if resp.status != 200:
                text = (await _head(resp.content, MAX_ERROR_BODY_BYTES)).decode("utf-8", errors="replace")
                if resp.status in RETRYABLE_STATUS:
                    raise Retryable(f"HTTP {resp.status}: {text[:300]}")
                raise Rejected(resp.status, text)
            async for event, data in sse.events(resp.content.iter_any()):
                if event == "token_ids":
                    turn.prompt_token_ids = annotation_ids(data)
                    if wants_ids and turn.stream:
                        await out.send(sse.format_event(data, event))
                    continue
                if event != "message":
                    continue
                if data.strip() == "[DONE]":
                    break
                try:
                    obj = parse_event(data)
                except Broken as exc:
                    raise _failure(state, f"upstream sent a malformed event: {exc}") from None
                if "error" in obj:
                    raise _failure(state, f"upstream error: {json.dumps(obj['error'])[:500]}")
                if obj.get("usage"):
                    turn.usage = obj["usage"]
                turn.response_id = turn.response_id or obj.get("id")
                nvext = obj.get("nvext") or {}
                if obj.get("choices"):
                    state.add_engine_data(nvext.get("engine_data"))
                    state.add_choices(obj, chat)
                state.last = obj
                if turn.stream:
                    client_obj = for_client(obj, wants_fields)
                    if client_obj is not None and (obj.get("choices") or wants_usage):
                        await out.send(sse.format_event(client_obj))
            if state.tokens == 0:
                raise Retryable("the upstream stream ended before any token")
    except (aiohttp.ClientError, asyncio.TimeoutError, sse.SSEError, ConnectionError) as exc:
        raise _failure(state, f"{type(exc).__name__}: {exc}") from None


async def _head(content, limit: int) -> bytes:
    """The first ``limit`` bytes of a body (fewer when it ends first)."""
    buf = bytearray()
    while len(buf) < limit:
        part = await content.read(limit - len(buf))
        if not part:
            break
        buf += part
    return bytes(buf)


def _failure(state: TurnState, reason: str) -> Exception:
    return Retryable(reason) if state.tokens == 0 else Broken(reason)
