"""``syncd.supervise``: a supervised task that raises, or returns while it should run, is logged, counted,
recorded and restarted with a growing backoff; stopping cancels it; a failing report hook changes nothing."""

from __future__ import annotations

import asyncio
import logging

from syncd.supervise import Failures, Supervisor


def test_a_failing_task_is_restarted_counted_and_visible(caplog):
    failures = Failures(kinds=("task",))
    seen = []

    def broken_hook(name, exc):
        seen.append((name, type(exc).__name__))
        raise RuntimeError("the report itself fails")

    async def main():
        sup = Supervisor("test owner", on_failure=failures, on_error=broken_hook, backoff_s=0.01, max_backoff_s=0.04)
        runs = []

        async def flaky():
            runs.append(asyncio.get_running_loop().time())
            if len(runs) <= 3:
                raise RecursionError("maximum recursion depth exceeded")
            if len(runs) == 4:
                return  # returning while the owner runs is a failure too
            await asyncio.sleep(3600)

        sup.spawn("poller", flaky)
        while len(runs) < 5:
            await asyncio.sleep(0.01)
        health = sup.health()["poller"]
        assert health["running"] and health["restarts"] == 4 and health["failures"] == 4
        assert "returned while test owner is running" in health["last_error"]
        assert sup.died() == ["poller"]
        await sup.stop()
        assert not sup.health()["poller"]["running"]

    with caplog.at_level(logging.ERROR, logger="syncd.supervise"):
        asyncio.run(main())
    assert failures.totals == {"task": 4}
    assert b'syncd_failures_total{kind="task"} 4.0' in failures.render()
    assert seen[0] == ("poller", "RecursionError") and len(seen) == 4
    failed = [r.getMessage() for r in caplog.records if "test owner: task poller failed" in r.getMessage()]
    assert sum("RecursionError: maximum recursion depth" in m for m in failed) == 3
    # the backoff doubles, up to its cap
    assert [m.rsplit("restarting in ", 1)[1] for m in failed] == ["0.01s", "0.02s", "0.04s", "0.04s"]


def test_a_one_shot_report_and_a_clean_run():
    async def main():
        sup = Supervisor("quiet")
        sup.spawn("ok", lambda: asyncio.sleep(3600))
        await asyncio.sleep(0.01)
        assert sup.died() == []
        sup.failed("connection from rank 2", ValueError("bad"), kind="connection")
        assert sup.died() == ["connection from rank 2"]
        assert sup.health()["connection from rank 2"]["last_error"] == "ValueError: bad"
        await sup.stop()

    asyncio.run(main())
