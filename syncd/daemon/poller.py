"""Noticing new versions: :class:`syncd.newest.VersionPoller` on a timer, with jitter and backoff.

One poll costs one conditional GET of the run's ``latest.json`` while nothing changed. What the poller reports
is always a version whose manifest was read, parsed and verified (through the daemon's
:class:`~syncd.manifest_source.ManifestSource`, which records and counts every refusal); garbage, forged,
replayed or far-future objects are skipped, never taken as a high-water mark (``syncd/newest.py``).

Waits between polls: ``interval_s`` ± ``jitter`` (a fraction), so a fleet of nodes does not poll in step;
after a store error, exponential backoff with full jitter up to ``backoff_max_s``. :meth:`Poller.run` ends
only when ``stop`` is set; anything but a store error propagates to its supervisor (:class:`syncd.supervise.Supervisor`).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time

from syncd import manifest as mf
from syncd.errors import StoreError
from syncd.newest import VersionPoller

log = logging.getLogger(__name__)


class Poller:
    """Polls ``store`` for the newest valid version of ``run_id`` and calls ``on_candidate(version)`` (from
    the event loop) whenever it finds one newer than any reported before.

    ``read(version) -> Manifest`` verifies a version (raises as :class:`~syncd.newest.VersionPoller` says);
    ``on_error(exc)`` is called for each failed poll, ``on_ok(missing_run)`` after a successful one, with
    ``missing_run`` a message saying that the run has no versions and which runs the store has (an
    operator's typo shows at once), or None."""

    def __init__(self, store, run_id: str, *, read, interval_s: float, jitter: float, backoff_max_s: float,
                 list_every_s: float, on_candidate, on_error=None, on_ok=None, retry_s: float = 60.0):
        self.store, self.run_id = store, mf.check_run_id(run_id)
        self.finder = VersionPoller(store, self.run_id, read=read, list_every_s=list_every_s, retry_s=retry_s,
                                    on_skip=lambda v, exc: None)  # ManifestSource logs and counts refusals
        self.interval_s, self.jitter, self.backoff_max_s = interval_s, jitter, backoff_max_s
        self.on_candidate, self.on_error, self.on_ok = on_candidate, on_error, on_ok
        self.newest: int | None = None
        self.failures = 0
        self.missing_run: str | None = None
        self._runs_listed_at = float("-inf")
        self.list_every_s = list_every_s

    def poll_once(self) -> int | None:
        """One poll (blocking): the newest valid version found, or None if nothing is known to have
        changed. Sets :attr:`missing_run`. Raises :class:`StoreError` if the store cannot be read."""
        v = self.finder.poll()
        if not self.finder.listed_empty or self.finder.newest is not None:  # the hint found versions: no listing
            self.missing_run = None
        elif self.missing_run is None or time.monotonic() - self._runs_listed_at >= self.list_every_s:
            self._runs_listed_at = time.monotonic()
            runs = [r for r in self.store.list_dirs("runs/") if r != self.run_id]
            self.missing_run = (f"run {self.run_id!r} has no versions in {self.store.url}; runs there: "
                                f"{', '.join(runs) if runs else 'none'}")
        return v

    def next_delay(self) -> float:
        if self.failures:
            cap = min(self.backoff_max_s, self.interval_s * 2 ** self.failures)
            return random.uniform(cap / 2, cap)
        return self.interval_s * random.uniform(1 - self.jitter, 1 + self.jitter)

    async def run(self, stop: asyncio.Event) -> None:
        """Poll until ``stop`` is set."""
        while not stop.is_set():
            try:
                v = await asyncio.to_thread(self.poll_once)
            except StoreError as exc:
                self.failures += 1
                log.warning("run %s: polling the store failed (%d in a row): %s", self.run_id, self.failures, exc)
                if self.on_error is not None:
                    self.on_error(exc)
            else:
                if self.failures:
                    log.info("run %s: the store answers again after %d failed polls", self.run_id, self.failures)
                self.failures = 0
                if self.on_ok is not None:
                    self.on_ok(self.missing_run)
                if v is not None and (self.newest is None or v > self.newest):
                    self.newest = v
                    self.on_candidate(v)
            try:
                await asyncio.wait_for(stop.wait(), self.next_delay())
            except asyncio.TimeoutError:
                pass
