"""``syncd.engine.proxy.sse``: parsing the frontend's event stream, however it is cut into chunks."""

from __future__ import annotations

import asyncio

import pytest

from syncd.engine.proxy.sse import SSEError, events, format_event

STREAM = (b'event: token_ids\n: "[1,2,3]"\n\n'
          b'data: {"a":1}\n\n'
          b': keep-alive comment\n\n'
          b'data: {"b":\n'
          b'data: 2}\r\n\r\n'
          b'data: [DONE]\n\n')


def _parse(chunks, **kw):
    async def go():
        async def gen():
            for c in chunks:
                yield c
        return [e async for e in events(gen(), **kw)]
    return asyncio.run(go())


@pytest.mark.parametrize("size", [1, 3, 7, len(STREAM)])
def test_events_whatever_the_chunking(size):
    chunks = [STREAM[i:i + size] for i in range(0, len(STREAM), size)]
    assert _parse(chunks) == [("token_ids", '"[1,2,3]"'), ("message", '{"a":1}'), ("message", '{"b":\n2}'),
                              ("message", "[DONE]")]


def test_bounded_and_strict():
    with pytest.raises(SSEError, match="over"):
        _parse([b"data: " + b"x" * 200 + b"\n\n"], max_event_bytes=100)
    with pytest.raises(SSEError, match="ended inside"):
        _parse([b'data: {"cut'])
    with pytest.raises(SSEError, match="UTF-8"):
        _parse([b"data: \xff\xfe\n\n"])


def test_format_round_trips():
    raw = format_event({"x": "a\nb"}) + format_event('"[4]"', "token_ids") + format_event("[DONE]")
    assert _parse([raw]) == [("message", '{"x":"a\\nb"}'), ("token_ids", '"[4]"'), ("message", "[DONE]")]
