"""Noticing new versions: a conditional GET of the run's ``latest.json`` hint, confirmed in the store.

One poll costs one request while nothing changed (``Store.get_if_changed`` with the last etag). When the
hint changes, the hinted version's manifest must exist, and the versions after it are probed (the hint may
lag); a missing or malformed hint, or one pointing nowhere, falls back to the version listing, which is
also read every ``list_every_s`` whatever the hint says. The poller only reports *candidate* version
numbers; the daemon verifies their manifests before using them (the hint is unsigned).

Waits between polls: ``interval_s`` ± ``jitter`` (a fraction), so a fleet of nodes does not poll in step;
after a store error, exponential backoff with full jitter up to ``backoff_max_s``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time

from syncd import manifest as mf
from syncd.errors import ObjectNotFound, StoreError

log = logging.getLogger(__name__)


class Poller:
    """Polls ``store`` for the newest version of ``run_id`` and calls ``on_candidate(version)`` (from the
    event loop) whenever it sees a version number newer than any reported before.

    ``on_error(exc)`` is called for each failed poll, ``on_ok()`` after a successful one."""

    def __init__(self, store, run_id: str, *, interval_s: float, jitter: float, backoff_max_s: float,
                 list_every_s: float, on_candidate, on_error=None, on_ok=None):
        self.store, self.run_id = store, mf.check_run_id(run_id)
        self.interval_s, self.jitter, self.backoff_max_s = interval_s, jitter, backoff_max_s
        self.list_every_s = list_every_s
        self.on_candidate, self.on_error, self.on_ok = on_candidate, on_error, on_ok
        self.newest: int | None = None
        self.failures = 0
        self._etag: str | None = None
        self._last_list = float("-inf")

    def poll_once(self) -> int | None:
        """One poll (blocking): the newest version number found, or None if nothing is known to have
        changed. Raises :class:`StoreError` if the store cannot be read."""
        force_list = time.monotonic() - self._last_list >= self.list_every_s
        try:
            got = self.store.get_if_changed(mf.latest_hint_key(self.run_id), self._etag)
        except ObjectNotFound:
            got, force_list = None, True
        if got is not None:
            body, self._etag = got
            hinted = self._hinted(body)
            if hinted is not None and self.store.exists(mf.manifest_key(self.run_id, hinted)):
                v = hinted
                while self.store.exists(mf.manifest_key(self.run_id, v + 1)):
                    v += 1
                self._last_list = time.monotonic()  # probing past the hint did what a listing would
                return v
            force_list = True
        if force_list:
            self._last_list = time.monotonic()
            return self._listed()
        return None

    def _hinted(self, body: bytes) -> int | None:
        try:
            v = json.loads(body[:4096])["version"]
            mf.version_dir(v)
            return v
        except (ValueError, KeyError, TypeError):
            log.warning("run %s: latest.json hint is malformed; listing versions instead", self.run_id)
            return None

    def _listed(self) -> int | None:
        dirs = self.store.list_dirs(mf.versions_prefix(self.run_id))
        for v in sorted((n for n in map(mf.parse_version_dir, dirs) if n is not None), reverse=True):
            if self.store.exists(mf.manifest_key(self.run_id, v)):
                return v
        return None

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
                    self.on_ok()
                if v is not None and (self.newest is None or v > self.newest):
                    self.newest = v
                    self.on_candidate(v)
            try:
                await asyncio.wait_for(stop.wait(), self.next_delay())
            except asyncio.TimeoutError:
                pass
