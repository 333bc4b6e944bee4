"""One attempt at a turn against the Dynamo frontend (``syncd.engine.proxy.server`` retries it): the SSE stream of a
completion, parsed strictly, recorded into the turn, and passed on to the client as it asked for it.

What is worth another attempt (:class:`Retryable`, while no token came back) is a failure of the upstream: no
connection, a timeout, HTTP 5xx, 408 or 429, a broken or malformed stream, an error event without a client-error
code -- and HTTP 404 while the frontend lists no model at all (it has not discovered a worker yet, or every
worker is down). What the frontend refuses as the client's mistake is passed on at once (:class:`Rejected`):
any other non-200 status (404 for a model it does not list while it lists others, 400 for a value it refuses)
and an error event with a 4xx code before the first token (a worker's refusal of an option, which the frontend
sends on a stream that already said 200)."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from http import HTTPStatus

import aiohttp
from aiohttp import web

from syncd.engine.proxy import sse
from syncd.engine.proxy.record import now
from syncd.engine.proxy.turn import (Broken, ClientGone, ClientStream, Rejected, Retryable, TurnState, annotation_ids,
                                     client_wants, error_response, for_client, parse_event)

log = logging.getLogger("syncd.engine.proxy.server")

__all__ = ["with_retries", "stream_once", "refusal", "refused_on_stream", "upstream_failed", "serves_models",
           "read_head", "MAX_ERROR_BODY_BYTES"]

MAX_ERROR_BODY_BYTES = 4096  # of a non-200 reply: what goes into the retry log, the turn's error and the record
MAX_MODELS_BYTES = 1 << 20  # of the frontend's model list, read to tell a wrong model name from discovery catching up
#: client-error statuses that still say the upstream failed (a timeout, its load)
_UPSTREAM_4XX = frozenset({408, 429})


def upstream_failed(status: int) -> bool:
    """Whether an HTTP status from the frontend is its failure (worth a retry), not the client's mistake."""
    return status >= 500 or status in _UPSTREAM_4XX


async def serves_models(session, upstream: str) -> bool:
    """Whether the frontend at ``upstream`` lists at least one model (``GET /v1/models``); False when it cannot
    say. A 404 from a frontend that lists none is its discovery catching up, not a wrong model name."""
    try:
        async with session.get(f"{upstream}/v1/models") as resp:
            if resp.status != 200:
                return False
            doc = json.loads(await read_head(resp.content, MAX_MODELS_BYTES))
    except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError, ValueError):
        return False
    return isinstance(doc, dict) and isinstance(doc.get("data"), list) and len(doc["data"]) > 0


async def refusal(session, upstream: str, resp) -> Exception:
    """The exception for a non-200 reply ``resp`` of the frontend: :class:`Retryable` for an upstream failure,
    :class:`Rejected` (the body passed on to the client) for the client's mistake (see the module docstring).
    Reads at most :data:`MAX_ERROR_BODY_BYTES` of the body (the rest is dropped with the connection)."""
    text = (await read_head(resp.content, MAX_ERROR_BODY_BYTES)).decode("utf-8", errors="replace")
    if upstream_failed(resp.status) or (resp.status == 404 and not await serves_models(session, upstream)):
        return Retryable(f"HTTP {resp.status}: {text[:300]}")
    return Rejected(resp.status, text)


def refused_on_stream(obj: dict) -> Rejected | None:
    """The :class:`Rejected` for an error event ``obj`` (``{"error": {"message", "type", "code"}}``) whose code
    says the client's request was refused (4xx, not 408/429), else None. Its body is the error as the frontend
    answers a client that did not ask for a stream; its event is ``obj``, for one that did."""
    err = obj.get("error")
    code = err.get("code") if isinstance(err, dict) else None
    if not (isinstance(code, int) and not isinstance(code, bool) and 400 <= code < 500 and not upstream_failed(code)):
        return None
    try:
        phrase = HTTPStatus(code).phrase
    except ValueError:
        phrase = "Client Error"
    whole = {"message": str(err.get("message") or phrase), "type": phrase, "code": code}
    return Rejected(code, json.dumps(whole, separators=(",", ":")), event=obj)


async def with_retries(once, session, upstream: str, config, state: TurnState, up_body: dict, endpoint: str,
                       out: ClientStream):
    """Run ``once`` (:func:`stream_once`, or the Responses call's) until an attempt streams the turn to its end:
    then None. A :class:`Retryable` failure is retried (up to ``config.retry_attempts`` tries within
    ``config.retry_deadline_s``, backoff ``config.retry_backoff_s`` doubling, jittered); anything else ends the
    turn at once. Else returns the response that tells the client why not; the turn is marked failed with the
    reason, and each attempt's error is in ``turn.attempts``."""
    turn = state.turn
    what = "answer" if endpoint == "responses" else "token"  # a Responses turn records no tokens
    deadline = time.monotonic() + config.retry_deadline_s
    for attempt in range(1, config.retry_attempts + 1):
        record = {"attempt": attempt, "started_at": now(), "error": None}
        turn.attempts.append(record)
        try:
            await once(session, upstream, state, up_body, endpoint, out)
            return None
        except Retryable as exc:
            record["error"] = str(exc)
            left = deadline - time.monotonic()
            if attempt == config.retry_attempts or left <= 0:
                turn.fail(f"no {what} after {attempt} attempts: {exc}")
                return error_response(502, turn.error, "upstream_unavailable")
            delay = min(left, config.retry_backoff_s * 2 ** (attempt - 1) * (0.5 + random.random()))
            log.info("turn %d of %s: attempt %d failed before any %s (%s); retrying in %.2f s", turn.index, out.tid,
                     attempt, what, exc, delay)
            await asyncio.sleep(delay)
        except Rejected as exc:  # the client's mistake: passed on at once, as the frontend answered it
            record["error"] = str(exc)
            turn.fail(str(exc))
            if exc.event is not None and turn.stream:
                return await out.refuse(exc.event)
            return web.Response(status=exc.status, body=exc.body.encode(), content_type="application/json",
                                headers=out.headers)
        except Broken as exc:
            record["error"] = str(exc)
            turn.fail(f"upstream failed after {state.tokens} tokens: {exc}" if endpoint != "responses"
                      else f"upstream failed after the answer began: {exc}")
            return await out.fail(turn.error)
        except ClientGone:
            turn.fail(f"the client went away after {state.tokens} tokens" if endpoint != "responses"
                      else "the client went away during the answer")
            return out.response


async def stream_once(session, upstream: str, state: TurnState, up_body: dict, endpoint: str,
                      out: ClientStream) -> None:
    """One attempt at a turn: stream ``up_body`` from the frontend at ``upstream`` (``/v1/<endpoint>``) into
    ``state``, passing the client what it asked for through ``out``. Raises :class:`Retryable` while no token
    came back, :class:`Broken` after, :class:`Rejected` for a status not worth a retry, ``ClientGone``. Of a
    non-200 reply at most :data:`MAX_ERROR_BODY_BYTES` are read (:func:`refusal`)."""
    turn = state.turn
    wants_fields, wants_ids, wants_usage = client_wants(turn.request)
    chat = endpoint == "chat/completions"
    try:
        async with session.post(f"{upstream}/v1/{endpoint}", json=up_body) as resp:
            if resp.status != 200:
                raise await refusal(session, upstream, resp)
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
                    refused = refused_on_stream(obj) if state.tokens == 0 else None
                    if refused is not None:  # a worker refused an option of the request: the client's mistake
                        raise refused
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


async def read_head(content, limit: int) -> bytes:
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
