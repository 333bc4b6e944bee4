"""``syncd.engine.proxy.server.Proxy``'s bookkeeping stays bounded for as long as the proxy lives: running-turn lists
go with their last turn, the finished-id memory is an LRU of ``MAX_WRITTEN_IDS``, and a compactor's live context
goes when its trajectory is written or fails to be (a real local-files store; no HTTP server is needed)."""

from __future__ import annotations

import asyncio

import pytest

import syncd.engine.proxy.server as server
from syncd.engine.proxy.compaction import CompactionConfig
from syncd.engine.proxy.record import RecordError, Turn
from syncd.engine.proxy.server import Proxy, ProxyConfig


def _proxy(tmp_path, **kw) -> Proxy:
    return Proxy(ProxyConfig(upstream="http://127.0.0.1:9", run_id="run", sandbox_id="sb", **kw),
                 str(tmp_path / "store"))


def test_a_running_turn_is_tracked_while_it_runs_and_its_list_goes_with_it(tmp_path):
    proxy = _proxy(tmp_path)

    async def go():
        traj = proxy._open("t")
        async with proxy.running_turn("t", traj, Turn(0, "completions", {}, False)) as state:
            assert proxy._running["t"] == [state]
            state.turn.status = "ok"
        assert "t" not in proxy._running and traj.turns[0].status == "ok"

        async def cancelled():
            async with proxy.running_turn("t", traj, Turn(1, "completions", {}, False), " of this segment"):
                await asyncio.sleep(60)

        task = asyncio.ensure_future(cancelled())
        await asyncio.sleep(0)
        assert len(proxy._running["t"]) == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert "t" not in proxy._running
        assert traj.turns[1].error == "the client went away after 0 tokens of this segment"
        async with proxy.running_turn("t", traj, Turn(2, "completions", {}, False)):
            pass  # left running: failed
        assert traj.turns[2].error == "the proxy stopped while this request was running"

    asyncio.run(go())


def test_finished_ids_are_remembered_up_to_the_cap(tmp_path, monkeypatch):
    monkeypatch.setattr(server, "MAX_WRITTEN_IDS", 3)
    proxy = _proxy(tmp_path)

    async def go():
        for i in range(5):
            proxy._open(f"t{i}")
            assert (await proxy.finish(f"t{i}"))["written"]
        with pytest.raises(RecordError, match="already finished"):
            proxy._open("t4")

    asyncio.run(go())
    assert list(proxy.written) == ["t2", "t3", "t4"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from syncd.engine.reference.make_tiny import write_model

    return write_model(tmp_path_factory.mktemp("bmodel") / "tiny", arch="qwen2", seed=1, hidden=16, layers=1,
                       heads=2, kv_heads=1, intermediate=32, max_positions=128)


def test_a_failed_write_drops_the_live_context_and_compactions_are_counted(tmp_path, model, monkeypatch):
    cfg = CompactionConfig.for_model(model, summary_prompt="\nSummarize:", resume_prompt="\nNotes:",
                                     continue_prompt="\nGo on:", summary_tokens=12, keep_prompt=8)
    proxy = _proxy(tmp_path, compaction=cfg)
    comp = proxy.compactor
    traj = proxy._open("t")
    comp._refuse(traj, 0, "too_long", "a test refusal")
    comp._live["t"] = object()  # the live context run() leaves behind, set by hand
    assert comp.stats() == {"done": 0, "refused": {"max_compactions": 0, "too_long": 1}, "live": 1}
    metrics = proxy.failures.render().decode()
    assert 'syncd_proxy_compactions_refused_total{reason="too_long"} 1.0' in metrics
    assert "syncd_proxy_compactions_total 0.0" in metrics

    async def unencodable(t):
        raise RecordError("cannot encode")

    monkeypatch.setattr(proxy.writer, "write", unencodable)
    with pytest.raises(RecordError):
        asyncio.run(proxy.finish("t"))
    assert "t" in proxy.trajectories and comp.stats()["live"] == 0
