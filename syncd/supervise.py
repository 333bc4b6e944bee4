"""Supervision of long-lived asyncio tasks, and the failure counter they report to.

A long-lived task (a poll loop, a heartbeat loop, a retry loop) must survive every exception. A
:class:`Supervisor` runs each one it :meth:`~Supervisor.spawn`\\ s in a loop: when the task raises anything
(``CancelledError`` aside) or returns while the supervisor is not stopping, the exception is logged with the
owner and task name, counted (``on_failure(kind)``, e.g. ``syncd_failures_total{kind="task"}``), recorded in
:meth:`~Supervisor.health` (restarts, last error, when), and the task is started again after a backoff
(doubling from ``backoff_s`` to ``max_backoff_s``, jittered; back to ``backoff_s`` once a run lasted
``healthy_after_s``). A task that dies is therefore never silent: it shows in the log, in the metric, and in
the health a status file or a test reads. :meth:`~Supervisor.failed` reports the exception of a short task
that is not restarted (one connection's handler) the same way.

:func:`failures_counter` is the one definition of ``syncd_failures_total{kind}``; :class:`Failures` is that
counter in a registry of its own, with plain totals, for a process that has no other metrics (the proxy).

Thread-safety: a :class:`Supervisor` belongs to the asyncio loop its tasks run on; :class:`Failures` is
thread-safe.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections import Counter as _Tally
from typing import Awaitable, Callable

log = logging.getLogger(__name__)

__all__ = ["Supervisor", "Failures", "failures_counter"]


def failures_counter(registry):
    """The ``syncd_failures_total{kind}`` counter, registered in ``registry`` (a ``CollectorRegistry``)."""
    from prometheus_client import Counter

    return Counter("syncd_failures", "Failures by kind", ["kind"], registry=registry)


class Failures:
    """``syncd_failures_total{kind}`` in its own registry (:attr:`registry`), plus plain totals
    (:attr:`totals`); call it with a kind to count one failure. ``kinds`` are shown at 0 from the start."""

    def __init__(self, kinds=()):
        from prometheus_client import CollectorRegistry

        self.registry = CollectorRegistry()
        self.counter = failures_counter(self.registry)
        self._totals: _Tally = _Tally()
        self._lock = threading.Lock()
        for kind in kinds:
            self.counter.labels(kind)

    def __call__(self, kind: str, n: int = 1) -> None:
        self.counter.labels(kind).inc(n)
        with self._lock:
            self._totals[kind] += n

    @property
    def totals(self) -> dict[str, int]:
        with self._lock:
            return dict(self._totals)

    def render(self) -> bytes:
        """The Prometheus exposition text of :attr:`registry`."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class Supervisor:
    """Runs and restarts the long-lived tasks of ``owner`` (a name for the log, e.g. ``"cluster node 3"``).

    ``on_failure(kind)``: counts a failure (a metric). ``on_error(name, exc)``: any further report (an event
    log); both are called on the loop and must not raise (what they raise is logged and ignored)."""

    def __init__(self, owner: str, *, on_failure: Callable[[str], None] | None = None,
                 on_error: Callable[[str, BaseException], None] | None = None, backoff_s: float = 0.2,
                 max_backoff_s: float = 10.0, healthy_after_s: float = 30.0, logger: logging.Logger = log):
        self.owner = owner
        self.on_failure, self.on_error = on_failure, on_error
        self.backoff_s, self.max_backoff_s, self.healthy_after_s = backoff_s, max_backoff_s, healthy_after_s
        self.log = logger
        self.stopping = False
        self._tasks: dict[str, asyncio.Task] = {}
        self._health: dict[str, dict] = {}

    def spawn(self, name: str, factory: Callable[[], Awaitable], *, kind: str = "task") -> asyncio.Task:
        """Start ``factory()`` as task ``name`` (unique among this supervisor's tasks) and keep it running."""
        if name in self._tasks and not self._tasks[name].done():
            raise ValueError(f"{self.owner}: a task named {name!r} is already running")
        self._health[name] = _new_health(running=True)
        task = self._tasks[name] = asyncio.ensure_future(self._keep(name, factory, kind))
        return task

    async def _keep(self, name: str, factory, kind: str) -> None:
        delay = self.backoff_s
        try:
            while not self.stopping:
                started = time.monotonic()
                try:
                    await factory()
                    if self.stopping:
                        return
                    exc: BaseException = RuntimeError(f"task {name} returned while {self.owner} is running")
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # noqa: BLE001 -- the point of supervision
                    exc = e
                if time.monotonic() - started >= self.healthy_after_s:
                    delay = self.backoff_s
                self.failed(name, exc, kind=kind, restart_in=delay)
                self._health[name]["restarts"] += 1
                await asyncio.sleep(delay * random.uniform(0.5, 1.0))
                delay = min(self.max_backoff_s, delay * 2)
        finally:
            self._health[name]["running"] = False

    def failed(self, name: str, exc: BaseException, *, kind: str = "task", restart_in: float | None = None) -> None:
        """Report that task ``name`` raised ``exc``: log (with the traceback), count, record, report."""
        what = f"{type(exc).__name__}: {exc}"
        then = f"; restarting in {restart_in:.2f}s" if restart_in is not None else ""
        self.log.error("%s: task %s failed: %s%s", self.owner, name, what, then, exc_info=exc)
        health = self._health.setdefault(name, _new_health(running=False))
        health["last_error"], health["last_error_at"] = what[:500], time.time()
        health["failures"] += 1
        for hook, args in ((self.on_failure, (kind,)), (self.on_error, (name, exc))):
            if hook is not None:
                try:
                    hook(*args)
                except Exception:  # noqa: BLE001 -- a broken report must not take the task down
                    self.log.exception("%s: reporting the failure of task %s failed", self.owner, name)

    def health(self) -> dict[str, dict]:
        """``{task name: {"running", "restarts", "failures", "last_error", "last_error_at"}}`` (plain
        values; ``last_error_at`` in Unix seconds)."""
        return {name: dict(h) for name, h in self._health.items()}

    def died(self) -> list[str]:
        """Names of the tasks that failed at least once (empty while all is well: what tests assert)."""
        return sorted(name for name, h in self._health.items() if h["failures"])

    async def stop(self) -> None:
        """Cancel every task and wait for them to end (idempotent)."""
        self.stopping = True
        tasks = [t for t in self._tasks.values() if not t.done()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _new_health(*, running: bool) -> dict:
    return {"running": running, "restarts": 0, "failures": 0, "last_error": None, "last_error_at": None}
