"""Supervision of the daemon's long-lived tasks (issue 14): every exception is caught, logged, counted in
``syncd_failures_total{kind}``, shown in the status file, and the task restarts after a backoff -- a task
that dies is something a test (and an operator) can see, never a silent stop."""

from __future__ import annotations

import asyncio
import json

import engine
from syncd.daemon import DaemonConfig, NodeDaemon
from syncd.store import Store
from syncd.tasks import TaskEnded, TaskHealth, supervise
from tests.daemon._procs import wait_until
from tests.daemon.conftest import KEY, RUN


class BrokenStore(Store):
    """A real file store whose conditional GET raises a bug-like error (not a StoreError) ``failures``
    times: what the forged hint of issue 14 did to the poller through RecursionError."""

    def __init__(self, root, failures: int):
        super().__init__(root)
        self.failures = failures

    def get_if_changed(self, key, etag, **kw):
        if self.failures > 0:
            self.failures -= 1
            raise RecursionError("injected: maximum recursion depth exceeded")
        return super().get_if_changed(key, etag, **kw)


def test_a_poller_that_dies_is_counted_shown_and_restarted(tmp_path, published):
    published.publish(2)
    store = BrokenStore(published.store.url.removeprefix("file://"), failures=3)
    eng = engine.StateDictEngine(published.zeros(), None)
    cfg = DaemonConfig(run_id=RUN, cache_dir=tmp_path / "cache", poll_interval_s=0.02, engine_check_s=0.05,
                       backoff_max_s=0.1)
    d = NodeDaemon(cfg, adapters={"e0": eng}, store=store, signing_key=KEY)

    async def main():
        task = asyncio.ensure_future(d.run())
        await wait_until(lambda: eng.version == 1, "the engine at version 1 despite the dying poller")
        await asyncio.to_thread(published.publish, 1)
        await wait_until(lambda: eng.version == 2, "version 2: the restarted poller still notices versions")
        d.request_stop()
        await task

    asyncio.run(main())
    assert d.metrics.totals["failures:poller"] == 3
    health = json.loads(d.status.path.read_text())["tasks"]["poller"]
    assert health["restarts"] == 3 and health["last_error"].startswith("RecursionError: injected")
    assert health["state"] == "stopped"
    assert 'syncd_failures_total{kind="poller"} 3.0' in d.metrics.render().decode()


def test_supervise_restarts_a_body_that_returns_and_stops_on_request():
    runs, failures = [], []

    async def main():
        stop = asyncio.Event()

        async def body():
            runs.append(1)
            if len(runs) == 3:
                stop.set()
                await asyncio.sleep(3600)  # cancelled below
            # returning while nobody asked to stop is a bug, treated like a crash

        health = TaskHealth("t")
        task = asyncio.ensure_future(supervise("t", body, stop=stop, health=health, initial_backoff_s=0.01,
                                               on_failure=lambda n, e: failures.append((n, type(e)))))
        await wait_until(stop.is_set, "the third run")
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        return health

    health = asyncio.run(main())
    assert len(runs) == 3 and failures == [("t", TaskEnded), ("t", TaskEnded)]
    assert health.restarts == 2 and health.state == "stopped"
