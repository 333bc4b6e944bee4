"""Getting a version's shards into the node cache, verified.

:class:`ShardSource` is the interface: ``await ensure(run_id, manifest)`` returns once every shard of
``manifest`` is in the node cache as a verified file (``<cache>/shards/<sha256>``), or raises. The daemon
uses :class:`StoreShardSource` (parallel downloads from the object store); the cluster layer can supply
its own (shards replicated between nodes) with the same contract.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol, runtime_checkable

from syncd import manifest as mf
from syncd.daemon import points
from syncd.versions import fetch_shard

log = logging.getLogger(__name__)


@runtime_checkable
class ShardSource(Protocol):
    async def ensure(self, run_id: str, manifest: mf.Manifest) -> None:
        """Return once every shard of ``manifest`` is a verified file in the node cache. Raises
        :class:`IntegrityError` for a shard whose bytes do not match the manifest, :class:`VersionNotFound`
        if one is gone, :class:`~syncd.errors.StoreError` if it cannot be had now."""


def check_cached(cache, s: mf.ShardEntry, metrics=None) -> str:
    """Blocking: re-hash shard ``s`` in ``cache``: ``"ok"``, ``"missing"``, or ``"bad"`` (the file no longer
    matches: removed, logged, counted in ``syncd_cache_corrupt_total`` and ``syncd_failures_total{kind="cache"}``,
    so that it is fetched again instead of being offered to an engine forever)."""
    status = cache.check(s.sha256, s.size)
    if status == "bad":
        log.error("cache %s: shard %s (%s) no longer matches its hash; removed it, it is fetched again",
                  cache.root, s.sha256[:16], s.key)
        if metrics is not None:
            metrics.count("cache_corrupt")
            metrics.failure("cache")
    return status


class StoreShardSource:
    """Downloads missing shards from ``store`` into ``cache``, ``concurrency`` at a time (each large shard
    itself in parallel ranged parts), checking size first and SHA-256 before a shard enters the cache.

    A shard already in the cache is trusted only once this process has hashed it (it may have rotted, or
    been altered, since another process -- or this daemon before a restart -- verified it): the first
    :meth:`ensure` that needs it re-hashes it (:func:`check_cached`), and a bad one is removed, counted
    and downloaded again. ``metrics``: a :class:`~syncd.daemon.metrics.DaemonMetrics`. Safe to call for
    several manifests at once."""

    def __init__(self, store, cache, *, concurrency: int = 8, metrics=None):
        self.store, self.cache, self.metrics = store, cache, metrics
        self._sem = asyncio.Semaphore(max(1, concurrency))
        self.fetched_bytes = 0
        self._trusted: set[str] = set()  # hashes this process verified in the cache

    def _check(self, s: mf.ShardEntry) -> str:
        if s.sha256 in self._trusted and self.cache.has(s.sha256, s.size):
            return "ok"
        status = check_cached(self.cache, s, self.metrics)
        if status == "ok":
            self._trusted.add(s.sha256)
        return status

    def forget(self, manifest: mf.Manifest) -> None:
        """Hash ``manifest``'s cached shards again before trusting them (an engine refused them)."""
        self._trusted.difference_update(s.sha256 for s in manifest.shards)

    async def ensure(self, run_id: str, manifest: mf.Manifest) -> None:
        found = await asyncio.gather(*(asyncio.to_thread(self._check, s) for s in manifest.shards))
        missing = [s for s, status in zip(manifest.shards, found) if status != "ok"]
        if not missing:
            return

        async def one(s):
            async with self._sem:
                await asyncio.to_thread(self._fetch, run_id, manifest, s)

        t0 = time.perf_counter()
        tasks = [asyncio.ensure_future(one(s)) for s in missing]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            raise
        if self.metrics is not None:
            self.metrics.download_s.observe(time.perf_counter() - t0)

    def _fetch(self, run_id: str, m: mf.Manifest, s: mf.ShardEntry) -> None:
        data = fetch_shard(self.store, run_id, m, s)
        points.reached("download", m.version, cache=self.cache, sha256=s.sha256, data=data)
        self.cache.put_verified(s.sha256, data)
        self._trusted.add(s.sha256)
        self.fetched_bytes += len(data)
        if self.metrics is not None:
            self.metrics.count("fetched_bytes", len(data))
            self.metrics.count("fetched_shards")
