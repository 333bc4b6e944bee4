"""Server-sent events: parse an upstream byte stream into ``(event, data)`` pairs, and format events.

Dynamo's frontend sends ``data: {json}`` events, ``data: [DONE]`` at the end, and annotation events
(``event: token_ids`` with the payload on a comment line ``: "..."``); :func:`events` hands a comment line
that follows an ``event:`` line back as that event's data. Events are bounded to ``max_event_bytes`` (a
longer one raises :class:`SSEError`), so a hostile upstream cannot make the proxy buffer without end.
"""

from __future__ import annotations

import json
from typing import AsyncIterable, AsyncIterator

__all__ = ["SSEError", "events", "format_event", "MAX_EVENT_BYTES"]

MAX_EVENT_BYTES = 256 << 20


class SSEError(ValueError):
    """The upstream event stream is malformed or an event is too large."""


async def events(chunks: AsyncIterable[bytes], *, max_event_bytes: int = MAX_EVENT_BYTES
                 ) -> AsyncIterator[tuple[str, str]]:
    """``(event name or "message", data)`` for each event in the byte chunks (see the module docstring)."""
    buf = bytearray()
    event: str | None = None
    data: list[str] = []
    size = 0

    def lines():
        while True:
            i = buf.find(b"\n")
            if i < 0:
                return
            line = bytes(buf[:i])
            del buf[:i + 1]
            yield line.rstrip(b"\r")

    async for chunk in chunks:
        buf += chunk
        if len(buf) > max_event_bytes:
            raise SSEError(f"an upstream event line is over {max_event_bytes} bytes")
        for raw in lines():
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise SSEError("upstream event stream is not UTF-8") from None
            if not line:
                if data or event is not None:
                    yield event or "message", "\n".join(data)
                event, data, size = None, [], 0
                continue
            size += len(raw)
            if size > max_event_bytes:
                raise SSEError(f"an upstream event is over {max_event_bytes} bytes")
            if line.startswith(":"):
                if event is not None and not data:
                    data.append(line[1:].lstrip(" "))
                continue
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if name == "event":
                event = value
            elif name == "data":
                data.append(value)
    if buf.strip():
        raise SSEError("upstream event stream ended inside an event")
    if data or event is not None:
        yield event or "message", "\n".join(data)


def format_event(data, event: str | None = None) -> bytes:
    """One SSE event; ``data`` is a string (sent as is) or a JSON value."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    out = head + "".join(f"data: {line}\n" for line in text.split("\n")) + "\n"
    try:
        return out.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate (valid in JSON escapes, not in UTF-8): send the escapes
        if isinstance(data, str):
            raise
        return format_event(json.dumps(data, ensure_ascii=True, separators=(",", ":")), event)
