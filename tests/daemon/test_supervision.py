"""Supervision of the daemon's long-lived tasks (issue 14; ``syncd.supervise``, tested on its own in
``tests/test_supervise.py``): every exception is caught, logged, counted in ``syncd_failures_total{kind}``,
shown in the status file, and the task restarts after a backoff -- a task that dies is something a test (and
an operator) can see, never a silent stop."""

from __future__ import annotations

import asyncio
import json

from syncd import engine
from syncd.daemon import DaemonConfig, NodeDaemon
from syncd.store import Store
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
    assert health["restarts"] == 3 and health["failures"] == 3
    assert health["last_error"].startswith("RecursionError: injected") and health["running"] is False
    assert 'syncd_failures_total{kind="poller"} 3.0' in d.metrics.render().decode()
