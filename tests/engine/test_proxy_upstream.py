"""``syncd.engine.proxy.upstream``: what a broken or hostile frontend sends is bounded before it reaches memory, the
turn's error and the record. The frontend here is a small aiohttp server on loopback standing in for a broken
Dynamo frontend (a real one never sends a 16 MiB error body: a mock, named as such)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from syncd.engine.proxy.record import Turn
from syncd.engine.proxy.turn import ClientStream, Rejected, Retryable, TurnState
from syncd.engine.proxy.upstream import MAX_ERROR_BODY_BYTES, stream_once

BIG = 16 << 20


async def _attempt(status: int):
    async def reply(request):
        resp = web.StreamResponse(status=status, headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        for _ in range(BIG // (1 << 20)):  # streamed: the proxy must stop reading, not just truncate
            await resp.write(b"x" * (1 << 20))
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", reply)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    turn = Turn(0, "completions", {"prompt": "x"}, False)
    try:
        async with aiohttp.ClientSession() as session:
            with pytest.raises((Rejected, Retryable)) as info:
                await stream_once(session, url, TurnState(turn), {"prompt": "x"}, "completions",
                                  ClientStream(None, turn, "t"))
    finally:
        await runner.cleanup()
    return info.value


def test_a_huge_error_body_is_read_only_up_to_the_limit():
    exc = asyncio.run(_attempt(400))
    assert isinstance(exc, Rejected) and exc.status == 400
    assert 0 < len(exc.body) <= MAX_ERROR_BODY_BYTES and len(str(exc)) < 2 * MAX_ERROR_BODY_BYTES


def test_a_huge_retryable_error_body_is_bounded_too():
    exc = asyncio.run(_attempt(503))
    assert isinstance(exc, Retryable) and "HTTP 503" in str(exc) and len(str(exc)) < MAX_ERROR_BODY_BYTES
