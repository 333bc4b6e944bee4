"""NodeDaemon in one process: real store, real publisher (real AdamW steps), real engines
(syncd.engine.StateDictEngine). Faults are injected by wrapping an engine (named as such below)."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import urllib.request

import pytest
import torch

import syncd.engine
from syncd import engine
from syncd import manifest as mf
from syncd.daemon import DaemonConfig, NodeDaemon
from syncd.daemon.fetcher import StoreShardSource
from syncd.daemon.status import StatusBoard, read_status
from syncd.errors import DeltaError
from syncd.signing import parse_key
from tests.daemon._procs import wait_until
from tests.daemon.conftest import KEY, RUN
from tests.store._models import assert_same


def make_daemon(tmp_path, published, engines, **kw):
    cfg = DaemonConfig(run_id=RUN, cache_dir=tmp_path / "cache", poll_interval_s=0.05, engine_check_s=0.1,
                       metrics_port=kw.pop("metrics_port", None), retry_failed_s=kw.pop("retry_failed_s", 60.0))
    return NodeDaemon(cfg, adapters=engines, store=kw.pop("store", published.store), signing_key=KEY, **kw)


def applied_versions(eng) -> list:
    return [v for op, v in eng.events if op in ("apply", "load_full")]


class FaultyEngine:
    """Fault injection around a real StateDictEngine: ``corrupt_after_apply`` flips one weight word right
    after the apply of that version (a faulty engine write); ``fail_apply`` makes that version's apply raise
    like an engine whose delta does not fit; ``fail_rollback`` makes rollback raise."""

    def __init__(self, inner, *, corrupt_after_apply=None, fail_apply=None, fail_rollback=False):
        self.inner = inner
        self.corrupt_after_apply, self.fail_apply, self.fail_rollback = corrupt_after_apply, fail_apply, fail_rollback
        self.gate = None  # a threading.Event: apply waits for it (to hold the critical section)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    @property
    def version(self):
        return self.inner.version

    def apply(self):
        if self.gate is not None:
            self.entered.set()
            self.gate.wait(30)
        staged = self.inner.updater.staged
        if staged is not None and staged.version == self.fail_apply:
            self.fail_apply = None
            raise DeltaError("injected: the staged delta does not fit")
        self.inner.apply()
        if self.inner.version == self.corrupt_after_apply:
            self.corrupt_after_apply = None
            self._flipped = next(iter(self.inner.state_dict().values())).view(-1).view(torch.int16)
            self._flipped[0] ^= 1

    def rollback(self):
        if self.fail_rollback:
            raise RuntimeError("injected: rollback failed")
        if getattr(self, "_flipped", None) is not None:  # the engine's rollback restores what it wrote
            self._flipped[0] ^= 1
            self._flipped = None
        self.inner.rollback()


def run_a_faulty_update(tmp_path, published, then, **faults):
    """A daemon on one :class:`FaultyEngine` (``faults``) around a StateDictEngine: versions 0 and 1 published, the
    engine at version 1, version 2 published; ``await then(inner, daemon)``, then the daemon stopped. Returns
    ``(inner, daemon)``."""
    published.publish(2)
    inner = engine.StateDictEngine(published.zeros(), None)
    d = make_daemon(tmp_path, published, {"e": FaultyEngine(inner, **faults)})

    async def main():
        task = asyncio.ensure_future(d.run())
        await wait_until(lambda: inner.version == 1, "version 1")
        await asyncio.to_thread(published.publish, 1)
        await then(inner, d)
        d.request_stop()
        await task

    asyncio.run(main())
    return inner, d


def test_rebuilds_follows_and_skips_ahead(tmp_path, published):
    published.publish(3)  # 0F 1 2
    engines = {f"e{i}": engine.StateDictEngine(published.zeros(), None) for i in range(2)}
    records = []

    async def follow():
        d = make_daemon(tmp_path, published, engines, on_update=records.append)
        task = asyncio.ensure_future(d.run())
        await wait_until(lambda: all(e.version == 2 for e in engines.values()), "rebuild to version 2")
        await asyncio.to_thread(published.publish, 1)  # 3F
        await wait_until(lambda: all(e.version == 3 for e in engines.values()), "version 3")
        d.request_stop()
        await task

    async def catch_up():  # 4 5 6F 7 arrived while no daemon ran: skip to 6F, then 7
        d = make_daemon(tmp_path, published, engines, metrics_port=0, on_update=records.append)
        task = asyncio.ensure_future(d.run())
        await wait_until(lambda: all(e.version == 7 for e in engines.values()), "version 7")
        scraped = {}

        def metrics_current() -> bool:  # the daemon records an update just after the engine reports it
            scraped["text"] = urllib.request.urlopen(d.metrics_url, timeout=10).read().decode()
            return all(f'syncd_engine_version{{engine="{n}"}} 7.0' in scraped["text"] for n in engines)
        await wait_until(metrics_current, "the metrics to show version 7 on every engine", timeout=20)
        metrics = scraped["text"]
        d.request_stop()
        await task
        return d, metrics

    asyncio.run(follow())
    published.publish(4)
    d, metrics = asyncio.run(catch_up())
    for e in engines.values():
        assert_same(e.state_dict(), published.states[7])
        assert applied_versions(e) == [0, 1, 2, 3, 6, 7]  # never twice, never 4/5 (skipped via full 6)
        assert e.paused is False
    assert 'syncd_engine_version{engine="e0"} 7.0' in metrics and "syncd_newest_version 7.0" in metrics
    assert 'syncd_versions_applied_total{engine="e1"} 2.0' in metrics
    status = json.loads(d.status.path.read_text())
    assert status["state"] == "stopped" and status["newest_version"] == 7
    assert {n: e["version"] for n, e in status["engines"].items()} == {"e0": 7, "e1": 7}
    assert [r["version"] for r in records] == [2, 2, 3, 6, 7]
    assert all(set(r["pause_s"]) == {"e0", "e1"} for r in records[2:])


class TimedChecksums:
    """A real StateDictEngine whose ``checksum`` calls are timed (``calls``: their ``time.monotonic()``); a
    wrapper, nothing else changed."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    @property
    def version(self):
        return self.inner.version

    def checksum(self, names=None):
        self.calls.append(time.monotonic())
        return self.inner.checksum(names)


def test_scrubs_are_spaced_by_the_scrub_interval_not_made_at_every_check(tmp_path, published):
    """A scrub is a call into the engine (a vLLM worker then busy-polls a core for 1 s): with checks every 20 ms and
    scrubs every 0.4 s, an idle engine's checksum is called, and at most once per 0.4 s."""
    published.publish(2)
    eng = TimedChecksums(engine.StateDictEngine(published.zeros(), None))
    cfg = DaemonConfig(run_id=RUN, cache_dir=tmp_path / "cache", poll_interval_s=0.05, engine_check_s=0.02,
                       engine_scrub_s=0.4, engine_scrub_bytes=1)  # one parameter per scrub
    d = NodeDaemon(cfg, adapters={"e": eng}, store=published.store, signing_key=KEY)

    async def main():
        task = asyncio.ensure_future(d.run())
        await wait_until(lambda: eng.version == 1 and d.drivers["e"].state == "serving", "version 1 serving")
        start = len(eng.calls)
        await wait_until(lambda: len(eng.calls) >= start + 4, "four scrubs")
        d.request_stop()
        await task
        return eng.calls[start:]

    scrubs = asyncio.run(main())
    gaps = [b - a for a, b in zip(scrubs, scrubs[1:])]
    assert min(gaps) >= 0.4, gaps  # the next scrub is due 0.4 s after the last one ended (checks: every 20 ms)


def test_checksum_mismatch_rolls_back_then_retries(tmp_path, published):
    async def then(inner, d):
        await wait_until(lambda: ("rollback", 1) in inner.events, "the rollback")
        await wait_until(lambda: not inner.paused, "resume after the rollback")
        assert inner.version == 1  # serving the verified previous version
        await wait_until(lambda: inner.version == 2, "version 2 on the retry")

    inner, d = run_a_faulty_update(tmp_path, published, then, corrupt_after_apply=2)
    assert_same(inner.state_dict(), published.states[2])
    assert d.metrics.totals["failures:checksum"] == 1
    ops = [op for op, _ in inner.events]
    i = ops.index("rollback")
    assert ops[i - 1] == "apply" and ops[i + 1] == "resume"  # resumed only after the rollback


def test_rollback_failure_rebuilds_and_never_serves_bad_weights(tmp_path, published):
    async def then(inner, d):
        await wait_until(lambda: d.metrics.totals["rebuilds:e"] >= 2 and inner.version == 2, "the rebuild")

    inner, d = run_a_faulty_update(tmp_path, published, then, corrupt_after_apply=2, fail_rollback=True)
    assert_same(inner.state_dict(), published.states[2])
    ops = inner.events
    bad = next(i for i, (op, v) in enumerate(ops) if op == "apply" and v == 2)
    # after the corrupted apply the engine stays paused until load_full rebuilt it: no resume in between
    nxt = [op for op, _ in ops[bad + 1:]]
    assert nxt.index("load_full") < nxt.index("resume")


def test_apply_error_keeps_the_previous_version_serving(tmp_path, published):
    async def then(inner, d):
        await wait_until(lambda: d.metrics.totals["failures:apply"] == 1, "the failed apply")
        await wait_until(lambda: not inner.paused, "resume on version 1")
        assert inner.version == 1
        await wait_until(lambda: inner.version == 2, "version 2 on the retry")

    inner, d = run_a_faulty_update(tmp_path, published, then, fail_apply=2)
    assert_same(inner.state_dict(), published.states[2])


def test_an_engine_refusing_a_version_does_not_hold_back_the_others_and_is_retried_with_backoff(tmp_path):
    """A tensor-parallel rank cannot decode format-2 deltas of the tensors it holds in slices: it refuses them at
    stage and keeps serving its version, the status names the tensor and the remedy, and the daemon retries it
    with backoff, not every engine check; the node's other engine, which holds every tensor whole, follows. A
    rank with no weights yet is rebuilt as far as it can go (the full version) and serves that, not paused."""
    from syncd.engine.sharding import tp_specs
    from tests.daemon.conftest import Published

    published = Published(tmp_path / "store", delta_format=2)
    try:
        published.publish(3)  # 0 full, then 1 and 2 in format 2
        states = published.states
        whole = engine.StateDictEngine({k: v.clone() for k, v in states[0].items()}, 0)
        rank = engine.StateDictEngine.from_full(states[0], tp_specs(states[0], rank=1, world_size=2, num_heads=4,
                                                                    num_kv_heads=2), 0)
        tries = []
        stage = rank.stage
        rank.stage = lambda update: (tries.append(update.version), stage(update))[1]
        fresh = engine.StateDictEngine.empty(tp_specs(states[0], rank=0, world_size=2, num_heads=4, num_kv_heads=2))
        d = make_daemon(tmp_path, published, {"whole": whole, "rank": rank, "fresh": fresh})

        async def main():
            task = asyncio.ensure_future(d.run())
            await wait_until(lambda: whole.version == 2, "the whole engine at version 2")
            await wait_until(lambda: fresh.version == 0 and not fresh.paused, "the fresh rank serving version 0")
            await wait_until(lambda: len(tries) >= 2, "the rank retried")
            first = len(tries)
            await asyncio.sleep(2.0)  # 20 engine checks: without backoff, about 20 more tries
            later = len(tries) - first
            status = json.loads(d.status.path.read_text())
            d.request_stop()
            await task
            return later, status

        later, status = asyncio.run(main())
    finally:
        published.close()
    assert_same(whole.state_dict(), states[2])
    assert rank.version == 0 and not rank.paused and set(tries) == {1}
    assert later <= 5, tries  # backoff: 0.1 s * 2^n between tries
    err = status["engines"]["rank"]["error"]
    assert "staging 1" in err and "context blocks (format 2)" in err and "format 1" in err, err
    assert status["engines"]["whole"]["version"] == 2 and not status["engines"]["whole"]["error"]
    assert status["engines"]["fresh"]["version"] == 0 and "staging 1" in status["engines"]["fresh"]["error"]
    assert [e for e in fresh.events if e[0] in ("load_full", "apply")] == [("load_full", 0)]


def test_stop_waits_for_the_update_in_progress(tmp_path, published):
    published.publish(1)
    inner = engine.StateDictEngine(published.zeros(), None)
    eng = FaultyEngine(inner)
    d = make_daemon(tmp_path, published, {"e": eng})

    async def main():
        task = asyncio.ensure_future(d.run())
        await wait_until(lambda: inner.version == 0, "version 0")
        eng.gate, eng.entered = threading.Event(), threading.Event()
        await asyncio.to_thread(published.publish, 1)
        await wait_until(eng.entered.is_set, "the apply to start")
        d.request_stop()  # while paused mid-update
        await asyncio.sleep(0.3)
        assert not task.done() and inner.paused
        eng.gate.set()
        await asyncio.wait_for(task, 30)

    asyncio.run(main())
    assert inner.version == 1 and not inner.paused  # the update finished, verified, and resumed
    assert_same(inner.state_dict(), published.states[1])


def test_a_restarted_daemon_continues_from_the_engines_version(tmp_path, published):
    published.publish(2)
    good = engine.StateDictEngine({k: v.clone() for k, v in published.states[1].items()}, 1)
    liar = syncd.engine.StateDictEngine({k: v.clone() for k, v in published.states[0].items()}, 1)  # claims 1, holds 0
    good.pause()  # as a daemon killed mid-update would leave it
    d = make_daemon(tmp_path, published, {"good": good, "liar": liar})

    async def main():
        task = asyncio.ensure_future(d.run())
        await wait_until(lambda: good.version == 1 and not good.paused, "good verified and resumed")
        await wait_until(lambda: liar.version == 1 and ("load_full", 0) in liar.events, "liar rebuilt")
        await asyncio.to_thread(published.publish, 1)
        await wait_until(lambda: good.version == 2 and liar.version == 2, "version 2")
        d.request_stop()
        await task

    asyncio.run(main())
    assert applied_versions(good) == [2]  # continued: no rebuild, nothing applied twice
    assert applied_versions(liar) == [0, 1, 2]
    for e in (good, liar):
        assert_same(e.state_dict(), published.states[2])


def test_external_delivery_without_polling(tmp_path, published):
    """The cluster layer's way in: shards put in the cache by someone else, then on_version_ready."""
    published.publish(2)
    inner = engine.StateDictEngine(published.zeros(), None)
    d = make_daemon(tmp_path, published, {"e": inner}, poll=False)
    delivered = []

    class ClusterLikeSource:  # stands in for the cluster layer: here it copies from the store itself
        def __init__(self):
            self.inner = StoreShardSource(published.store, d.cache)

        async def ensure(self, run_id, manifest):
            delivered.append(manifest.version)
            await self.inner.ensure(run_id, manifest)

    d.source = ClusterLikeSource()

    async def main():
        task = asyncio.ensure_future(d.run())
        raw0 = published.store.get(f"runs/{RUN}/versions/{0:012d}/manifest.json")
        await d.on_version_ready(raw0)  # as bytes
        raw = published.store.get(f"runs/{RUN}/versions/{1:012d}/manifest.json")
        await d.on_version_ready(mf.parse(raw, key=parse_key(KEY)))  # or parsed, as the cluster layer holds it
        await wait_until(lambda: inner.version == 1, "version 1")
        with pytest.raises(Exception, match="signature"):
            await d.on_version_ready(raw.replace(b'"step":1', b'"step":9'))
        d.request_stop()
        await task

    asyncio.run(main())
    assert_same(inner.state_dict(), published.states[1])
    assert sorted(set(delivered)) == [0, 1]


def test_the_status_file_follows_a_store_outage_between_rounds(tmp_path, published):
    """The store going away and coming back shows in the status file between update rounds (engine checks
    here are a minute apart, beyond the test's waits): the change after an outage was written only by the
    next round before, and a change within ``min_interval_s`` of the last write was dropped until then. A stop
    ends the wait between rounds (it waited for the next engine check before)."""
    published.publish(1)
    inner = engine.StateDictEngine(published.zeros(), None)
    cfg = DaemonConfig(run_id=RUN, cache_dir=tmp_path / "cache", poll_interval_s=0.05, engine_check_s=60.0,
                       engine_lease_s=120.0, backoff_max_s=0.4)
    d = NodeDaemon(cfg, adapters={"e": inner}, store=published.store, signing_key=KEY)
    d.status.min_interval_s = 1.0  # wider than the poll backoff: the first change after a write is deferred
    root, away = tmp_path / "store", tmp_path / "store-away"

    def shown():
        return read_status(d.status.path)

    async def main():
        task = asyncio.ensure_future(d.run())
        await wait_until(lambda: inner.version == 0 and shown()["engines"]["e"]["version"] == 0, "version 0")
        os.rename(root, away)
        root.write_bytes(b"")  # every request to the store fails
        await wait_until(lambda: shown()["store_error"], "the outage in the status file", timeout=30)
        root.unlink()
        os.rename(away, root)
        await wait_until(lambda: shown()["store_error"] is None, "the recovery in the status file", timeout=30)
        assert not task.done()
        d.request_stop()
        await asyncio.wait_for(task, 30)

    asyncio.run(main())
    assert shown()["state"] == "stopped"


def test_a_status_write_too_soon_after_the_last_is_refused_not_lost(tmp_path):
    board = StatusBoard(tmp_path / "s.json", run_id=RUN)
    board.min_interval_s = 60.0
    assert board.write(force=True)
    board.set(store_error="boom")
    assert not board.write()  # the caller is told, and writes it later
    assert read_status(board.path)["store_error"] is None
    assert board.write(force=True) and read_status(board.path)["store_error"] == "boom"
