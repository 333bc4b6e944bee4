"""One turn of the proxy: a single client request to ``/v1/chat/completions`` or ``/v1/completions``, with
every upstream attempt it takes (``syncd.engine.proxy.server`` runs the turn loop and its retries).

* :func:`parse_body` reads a client's body strictly (``syncd.jsonsafe``: bounded size and depth, no
  ``NaN``/``Infinity``, nothing the record's strict encoder would refuse) and checks the members the proxy
  itself reads, so a bad body is refused with a 400 before a turn exists; :func:`parse_event` does the
  same for each event from the frontend.
* :func:`upstream_body` rewrites the client's body into what the proxy asks of the frontend (always a
  stream, with usage, ``engine_data`` and the prompt's ``token_ids`` annotation); :func:`client_wants` says
  which of those the client itself asked for, and :func:`for_client` strips a chunk down to that.
* :class:`TurnState` owns the turn's :class:`~syncd.engine.proxy.record.Turn` while it runs and folds each chunk
  into it: the ``engine_data`` token ids, versions and log-probabilities (segment by segment, so a gap in
  the token record is an error, never a silent hole) and the choices' text, tool calls and finish reason.
  :func:`annotation_ids` parses the prompt's ``token_ids`` annotation.
* :class:`ClientStream` owns the response to the client: headers go out lazily, at the first streamed
  event, so a turn that fails before any token can still answer with an error status
  (:func:`error_response`).

Raised: :class:`BadRequest` (the client's body is refused), :class:`Retryable` (failed before any token:
worth another attempt), :class:`Rejected` (the frontend refused the request as the client's mistake: passed
on at once), :class:`Broken` (failed after tokens, or the upstream sent a malformed record: the turn fails),
:class:`ClientGone` (writing to the client failed).

Thread-safety: none; a turn's objects are used from the one asyncio loop that runs the proxy.
"""

from __future__ import annotations

import asyncio
import math

import aiohttp
from aiohttp import web

from syncd.engine.proxy import sse
from syncd.engine.proxy.record import Turn
from syncd import jsonsafe

__all__ = ["TRAJECTORY_HEADER", "TurnState", "ClientStream", "client_wants", "upstream_body", "for_client",
           "parse_body", "parse_event", "annotation_ids", "error_response", "check_complete", "whole_response",
           "BadRequest", "Retryable", "Rejected", "Broken", "ClientGone"]

TRAJECTORY_HEADER = "X-Syncd-Trajectory"
#: nesting bound of client bodies and upstream events (a record nests a body 3 levels deeper)
MAX_DEPTH = 64


class BadRequest(jsonsafe.JSONError):
    """The client's body is refused (HTTP 400); the message says what is wrong."""


class Retryable(Exception):
    """Failed before any token: worth another attempt."""


class Rejected(Exception):
    """The frontend refused the request as the client's mistake: ``status`` and ``body`` are what a client that
    asked for a whole response gets; ``event`` (an error event, when the refusal came on a stream that had
    said 200) is what a streamed client gets, followed by the end of the stream, as from the frontend."""

    def __init__(self, status: int, body: str, event: dict | None = None):
        super().__init__(f"upstream refused the request: HTTP {status}: {body[:500]}")
        self.status, self.body, self.event = status, body, event


class Broken(Exception):
    """Failed after tokens came back: the turn fails."""


class ClientGone(Exception):
    pass


def parse_body(raw: bytes, *, max_bytes: int, what: str = "request body") -> dict:
    """The client's JSON object, strictly parsed (see the module docstring). Raises :class:`BadRequest`."""
    body = jsonsafe.loads(raw, what=what, max_bytes=max_bytes, max_depth=MAX_DEPTH, error=BadRequest)
    if not isinstance(body, dict):
        raise BadRequest(f"{what} must be a JSON object")
    for k in ("nvext", "stream_options"):
        if body.get(k) is not None and not isinstance(body[k], dict):
            raise BadRequest(f"{what}: '{k}' must be a JSON object")
    nvext = body.get("nvext") or {}
    for k in ("extra_fields", "annotations"):
        v = nvext.get(k)
        if v is not None and not (isinstance(v, list) and all(isinstance(x, str) for x in v)):
            raise BadRequest(f"{what}: 'nvext.{k}' must be a list of strings")
    return body


def parse_event(data: str) -> dict:
    """One upstream ``data:`` event as a JSON object, strictly parsed; raises :class:`Broken` (the caller
    turns it into a retry when no token came yet)."""
    try:
        obj = jsonsafe.loads(data.encode("utf-8"), what="upstream event", max_bytes=sse.MAX_EVENT_BYTES,
                             max_depth=MAX_DEPTH)
    except jsonsafe.JSONError as exc:
        raise Broken(f"{exc} (event {data[:200]!r})") from None
    if not isinstance(obj, dict):
        raise Broken(f"upstream event is not a JSON object: {data[:200]!r}")
    if obj.get("usage") is not None and not isinstance(obj["usage"], dict):
        raise Broken(f"upstream event with a malformed usage member: {data[:200]!r}")
    return obj


def client_wants(body: dict) -> tuple[set, bool, bool]:
    """(nvext extra fields, token_ids annotation, usage chunk) the client itself asked for."""
    nvext = body.get("nvext") if isinstance(body.get("nvext"), dict) else {}
    fields = set(nvext.get("extra_fields") or []) if isinstance(nvext.get("extra_fields"), list) else set()
    annotations = nvext.get("annotations") if isinstance(nvext.get("annotations"), list) else []
    opts = body.get("stream_options") if isinstance(body.get("stream_options"), dict) else {}
    return fields, "token_ids" in annotations, bool(opts.get("include_usage"))


def upstream_body(body: dict) -> dict:
    up = dict(body)
    up["stream"] = True
    up["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    nvext = dict(body.get("nvext") or {})
    nvext["extra_fields"] = sorted(set(nvext.get("extra_fields") or []) | {"engine_data"})
    nvext["annotations"] = sorted(set(nvext.get("annotations") or []) | {"token_ids"})
    up["nvext"] = nvext
    return up


class TurnState:
    """What one turn has streamed so far (the engine_data bookkeeping)."""

    def __init__(self, turn: Turn):
        self.turn = turn
        self.choices: dict[int, dict] = {}
        self.last: dict | None = None
        self.body: bytes | None = None  # a whole upstream reply passed on as it came (/v1/responses)
        self.done = asyncio.Event()

    @property
    def tokens(self) -> int:
        return len(self.turn.output_token_ids)

    def add_engine_data(self, ed) -> None:
        t = self.turn
        if not isinstance(ed, dict) or ed.get("syncd") != 1:
            raise Broken(f"a chunk without syncd engine_data (got {str(ed)[:200]}); is the worker an "
                          "syncd.engine.dynamo worker?")
        ids, versions, lps = ed.get("token_ids"), ed.get("versions"), ed.get("logprobs")
        rid, index = ed.get("request_id"), ed.get("index")
        if not (isinstance(ids, list) and isinstance(versions, list) and isinstance(lps, list)
                and len(ids) == len(versions) == len(lps) and _is_int(index) and isinstance(rid, str)
                and all(map(_is_int, ids)) and all(v is None or _is_int(v) for v in versions)
                and all(x is None or (isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x))
                        for x in lps)):
            raise Broken(f"malformed engine_data {str(ed)[:200]}")
        seg = t.segments[-1] if t.segments else None
        if seg is None or (index == 0 and seg["count"] > 0):
            seg = {"request_id": rid, "start": len(t.output_token_ids), "count": 0}
            t.segments.append(seg)
            t.request_id = t.request_id or rid
        elif index != seg["count"]:
            raise Broken(f"token {index} of engine request {rid} arrived after {seg['count']} of its tokens: "
                          "the token record would have a gap")
        t.output_token_ids += ids
        t.versions += versions
        t.logprobs += lps
        seg["count"] += len(ids)

    def add_choices(self, obj: dict, chat: bool) -> None:
        choices = obj.get("choices") or []
        if not isinstance(choices, list) or not all(_choice_ok(ch, chat) for ch in choices):
            raise Broken(f"malformed choices {str(choices)[:200]}")
        for ch in choices:
            i = ch.get("index", 0)
            acc = self.choices.setdefault(i, {"text": "", "finish_reason": None, "tool_calls": {}, "role": None,
                                              "logprobs": None})
            _add_logprobs(acc, ch.get("logprobs"), chat)
            if chat:
                delta = ch.get("delta") or {}
                acc["text"] += delta.get("content") or ""
                acc["role"] = acc["role"] or delta.get("role")
                for tc in delta.get("tool_calls") or []:
                    slot = acc["tool_calls"].setdefault(tc.get("index", 0), {"id": None, "type": "function",
                                                                             "function": {"name": "", "arguments": ""}})
                    slot["id"] = tc.get("id") or slot["id"]
                    fn = tc.get("function") or {}
                    slot["function"]["name"] += fn.get("name") or ""
                    slot["function"]["arguments"] += fn.get("arguments") or ""
            else:
                acc["text"] += ch.get("text") or ""
            if ch.get("finish_reason"):
                acc["finish_reason"] = ch["finish_reason"]
        self.turn.text = self.choices.get(0, {}).get("text", "")
        self.turn.finish_reason = self.choices.get(0, {}).get("finish_reason")


#: the list members of a choice's ``logprobs`` that a whole response concatenates over the stream's chunks
_LOGPROB_LISTS = {True: ("content", "refusal"), False: ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def _add_logprobs(acc: dict, lp, chat: bool) -> None:
    """Fold one chunk's ``logprobs`` of a choice into ``acc["logprobs"]`` the way the frontend aggregates a
    non-streamed response: every list member concatenated in order (chat: ``content``, ``refusal``;
    completions: ``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``), other members as the
    first chunk had them. None (not asked for) stays None."""
    if lp is None:
        return
    if not isinstance(lp, dict):
        raise Broken(f"malformed logprobs {str(lp)[:200]}")
    if acc["logprobs"] is None:
        acc["logprobs"] = {k: (list(v) if isinstance(v, list) else v) for k, v in lp.items()}
        return
    have = acc["logprobs"]
    for k in _LOGPROB_LISTS[chat]:
        v = lp.get(k)
        if isinstance(v, list):
            have[k] = (have.get(k) if isinstance(have.get(k), list) else []) + v


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _str_or_none(v) -> bool:
    return v is None or isinstance(v, str)


def _choice_ok(ch, chat: bool) -> bool:
    """The members of a choice that the proxy folds into the turn have the types it folds."""
    if not isinstance(ch, dict) or not _is_int(ch.get("index", 0)) or not _str_or_none(ch.get("finish_reason")):
        return False
    if not chat:
        return _str_or_none(ch.get("text"))
    delta = ch.get("delta") or {}
    if not isinstance(delta, dict) or not _str_or_none(delta.get("content")) or not _str_or_none(delta.get("role")):
        return False
    calls = delta.get("tool_calls") or []
    return isinstance(calls, list) and all(
        isinstance(tc, dict) and _is_int(tc.get("index", 0)) and _str_or_none(tc.get("id"))
        and isinstance(tc.get("function") or {}, dict)
        and all(_str_or_none((tc.get("function") or {}).get(k)) for k in ("name", "arguments")) for tc in calls)


def for_client(obj: dict, wants_fields: set) -> dict | None:
    """The chunk as the client would have had it from the frontend: the ``nvext`` members it did not ask for
    removed, and None for a chunk that carried nothing else (the frontend sends a token whose text is still
    incomplete -- part of a UTF-8 character -- only because the proxy asked for its ``engine_data``; without
    that ask it folds the token into the next chunk, so the proxy drops the empty one)."""
    if "nvext" not in obj:
        return obj
    obj = dict(obj)
    nvext = {k: v for k, v in (obj.pop("nvext") or {}).items() if k in wants_fields}
    if nvext:
        obj["nvext"] = nvext
    elif obj.get("choices") and not obj.get("usage") and all(_carries_nothing(ch) for ch in obj["choices"]):
        return None
    return obj


def _carries_nothing(ch) -> bool:
    if not isinstance(ch, dict) or ch.get("finish_reason") is not None or ch.get("logprobs") is not None:
        return False
    if "delta" in ch:
        return not any(v not in (None, "", []) for v in (ch.get("delta") or {}).values())
    return not ch.get("text")


def annotation_ids(data: str) -> list[int]:
    try:
        ids = jsonsafe.loads(data.encode("utf-8"), what="token_ids", max_bytes=sse.MAX_EVENT_BYTES, max_depth=2)
        if isinstance(ids, str):
            ids = jsonsafe.loads(ids.encode("utf-8"), what="token_ids", max_bytes=sse.MAX_EVENT_BYTES, max_depth=1)
    except jsonsafe.JSONError:
        raise Broken(f"malformed token_ids annotation {data[:200]}") from None
    if not isinstance(ids, list) or not all(map(_is_int, ids)):
        raise Broken(f"malformed token_ids annotation {data[:200]}")
    return ids


def error_response(status: int, message: str, kind: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


class ClientStream:
    """The response to the client: headers are sent lazily, at the first streamed event, so a turn that
    fails before any token can still answer with an error status."""

    def __init__(self, request: web.Request, turn: Turn, tid: str):
        self.request, self.turn, self.tid = request, turn, tid
        self.headers = {TRAJECTORY_HEADER: tid, "X-Syncd-Turn": str(turn.index)}
        self.response: web.StreamResponse | None = None

    async def send(self, data: bytes) -> None:
        try:
            if self.response is None:
                self.response = web.StreamResponse(status=200, headers={
                    **self.headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
                await self.response.prepare(self.request)
            await self.response.write(data)
        except (ConnectionError, aiohttp.ClientConnectionResetError) as exc:
            raise ClientGone(str(exc)) from None

    async def end(self) -> web.StreamResponse:
        await self.send(b"data: [DONE]\n\n")
        await self.response.write_eof()
        return self.response

    async def refuse(self, event: dict) -> web.StreamResponse:
        """Pass on the frontend's refusal of a streamed request (an error event, then the end of the stream)."""
        try:
            await self.send(sse.format_event(event))
            await self.end()
        except ClientGone:
            pass
        return self.response

    async def fail(self, message: str) -> web.StreamResponse:
        """Tell the client (an error event on a started stream, else an HTTP 502)."""
        if self.response is None:
            return error_response(502, message, "upstream_error")
        try:
            await self.send(sse.format_event({"error": {"message": message, "type": "upstream_error", "code": 502}}))
            await self.end()
        except ClientGone:
            pass
        return self.response


def check_complete(state: TurnState) -> None:
    """Fail the turn unless its record is whole and agrees with the frontend's counts."""
    t = state.turn
    if t.status == "failed":
        return
    if t.finish_reason is None:
        t.fail(f"the upstream stream ended without a finish reason after {state.tokens} tokens")
    elif not t.prompt_token_ids:
        t.fail("the frontend sent no prompt token ids (nvext annotation token_ids)")
    elif t.usage is None:
        t.fail("the frontend sent no usage counts to check the token record against")
    elif t.usage.get("completion_tokens") != state.tokens:
        t.fail(f"token record incomplete: the frontend counted {t.usage.get('completion_tokens')} output "
               f"tokens, the proxy recorded {state.tokens}")
    elif t.usage.get("prompt_tokens") != len(t.prompt_token_ids):
        t.fail(f"prompt record mismatch: the frontend counted {t.usage.get('prompt_tokens')} prompt tokens, "
               f"its token_ids annotation had {len(t.prompt_token_ids)}")

def whole_response(state: TurnState, endpoint: str) -> dict:
    """The non-streamed response of a finished turn, with what the client asked for of ``nvext``."""
    last = state.last or {}
    wants_fields, _, _ = client_wants(state.turn.request)
    choices = []
    for i, acc in sorted(state.choices.items()):
        if endpoint == "chat/completions":
            msg = {"role": acc["role"] or "assistant", "content": acc["text"], "refusal": None}  # as the frontend
            if acc["tool_calls"]:
                msg["tool_calls"] = [acc["tool_calls"][k] for k in sorted(acc["tool_calls"])]
            choices.append({"index": i, "message": msg, "finish_reason": acc["finish_reason"],
                            "logprobs": acc["logprobs"]})
        else:
            choices.append({"index": i, "text": acc["text"], "finish_reason": acc["finish_reason"],
                            "logprobs": acc["logprobs"]})
    out = {"id": state.turn.response_id, "object": "chat.completion" if endpoint == "chat/completions"
           else "text_completion", "created": last.get("created"), "model": last.get("model"),
           "choices": choices, "usage": state.turn.usage}
    if "system_fingerprint" in last:  # the frontend's completions carry it (null), its chats do not
        out["system_fingerprint"] = last["system_fingerprint"]
    if wants_fields:
        nvext = {k: v for k, v in (last.get("nvext") or {}).items() if k in wants_fields}
        if "engine_data" in wants_fields:
            t = state.turn
            nvext["engine_data"] = {"syncd": 1, "request_id": t.request_id, "token_ids": t.output_token_ids,
                                    "versions": t.versions, "logprobs": t.logprobs}
        out["nvext"] = nvext
    return out
