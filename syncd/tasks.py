"""Supervision of long-lived asyncio tasks: a task that dies is restarted, never lost silently.

:func:`supervise` runs ``await body()`` until ``stop`` is set. If the body raises anything but
``CancelledError`` -- or returns while nobody asked it to stop -- the failure is logged with its traceback and
the task's name, reported to ``on_failure(name, exc)`` (the caller counts it, e.g. in
``syncd_failures_total{kind}``, and shows it in its status), and the body is started again after a backoff
that doubles per consecutive failure (full jitter, from ``initial_backoff_s`` up to ``max_backoff_s``; a body
that ran for ``healthy_after_s`` resets it). :class:`TaskHealth` is the record a status file shows.

Use from the event loop that runs the task. ``on_failure`` must not raise (if it does, that is logged too).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)


class TaskEnded(RuntimeError):
    """A supervised body returned although it was not asked to stop (a bug, treated like a crash)."""


@dataclass
class TaskHealth:
    """What a status file says about one supervised task."""

    name: str
    state: str = "starting"  # running | restarting | stopped
    restarts: int = 0
    last_error: str | None = None
    last_error_at: float | None = None

    def to_json(self) -> dict:
        return {"state": self.state, "restarts": self.restarts, "last_error": self.last_error,
                "last_error_at": self.last_error_at}


async def _wait(stop: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except asyncio.TimeoutError:
        pass


async def supervise(name: str, body, *, stop: asyncio.Event, on_failure=None, health: TaskHealth | None = None,
                    initial_backoff_s: float = 0.5, max_backoff_s: float = 30.0, healthy_after_s: float = 60.0,
                    context: str = "") -> None:
    """Run ``body`` (an async callable taking no arguments) under supervision until ``stop`` is set; see
    the module docstring. ``health`` (optional) is kept up to date; ``context`` is added to log lines."""
    health = health if health is not None else TaskHealth(name)
    failures = 0
    while not stop.is_set():
        started = time.monotonic()
        health.state = "running"
        try:
            await body()
            if stop.is_set():
                break
            raise TaskEnded(f"task {name} returned while it should run")
        except asyncio.CancelledError:
            health.state = "stopped"
            raise
        except Exception as exc:  # noqa: BLE001 -- the point: every exception is caught, logged, counted
            if time.monotonic() - started >= healthy_after_s:
                failures = 0
            failures += 1
            health.restarts += 1
            health.last_error = f"{type(exc).__name__}: {exc}"[:2000]
            health.last_error_at = time.time()
            health.state = "restarting"
            delay = random.uniform(0.5, 1.0) * min(max_backoff_s, initial_backoff_s * 2 ** (failures - 1))
            log.error("task %s%s died (%d in a row): %s: %s; restarting in %.2fs", name,
                      f" ({context})" if context else "", failures, type(exc).__name__, exc, delay, exc_info=exc)
            if on_failure is not None:
                try:
                    on_failure(name, exc)
                except Exception:  # noqa: BLE001
                    log.exception("task %s: reporting its failure failed", name)
            await _wait(stop, delay)
    health.state = "stopped"
