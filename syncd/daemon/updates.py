"""The update path of :class:`~syncd.daemon.NodeDaemon`: from a plan to engines serving its target.

*Fetch* every shard of the plan into the node cache (a full cache disk is counted, shown and retried after a
backoff); *stage* each version on a group of engines while they serve; then, one engine at a time, the
critical section ``pause -> apply -> checksum check -> resume`` (:meth:`EngineDriver.apply_staged
<syncd.daemon.driver.EngineDriver.apply_staged>`); or *rebuild* an engine with unknown weights
(:meth:`EngineDriver.rebuild <syncd.daemon.driver.EngineDriver.rebuild>`). An engine that refuses cached shards
(staging or a rebuild fails) makes the update path re-hash them: bad ones are removed, counted and fetched again
instead of being offered forever. Afterwards the cache is trimmed, keeping what a restart needs.

:class:`UpdatePath` is a collaborator the daemon holds: it is handed the objects it works on and the few live
facts of the daemon it reads (the newest version, whether a stop was asked) as callables.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
from typing import Callable, Mapping

from syncd import manifest as mf
from syncd.cache import ShardCache
from syncd.daemon import points
from syncd.daemon.driver import EngineDriver, NeedsRebuild, RebuildFailed, UpdateFailed
from syncd.daemon.fetcher import ShardSource, check_cached
from syncd.daemon.metrics import DaemonMetrics
from syncd.daemon.planner import Plan, plan_update, walk_back
from syncd.daemon.stager import stage_group
from syncd.daemon.status import StatusBoard
from syncd.errors import IntegrityError, SyncdError, VersionNotFound
from syncd.manifest_source import ManifestSource

log = logging.getLogger(__name__)


def _created(rfc3339: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()


class UpdatePath:
    """Moves groups of engines of run ``run_id`` to the newest version (see the module docstring).

    Handed by its owner (the daemon): ``manifests`` (the verified manifests), ``source`` (fills ``cache``, the
    node cache; replaceable between rounds), ``drivers`` (every engine by name; read for what the cache must
    keep, the groups to move are passed to :meth:`advance`), ``metrics`` and ``status`` (written here: update
    records, ``cache_error``, an engine's ``last_pause_s``), ``engine_check_s`` (seconds; the base of the
    backoffs), and callables: ``newest()`` (the newest version noticed, None before any; read during a round
    to re-plan when a newer one arrives), ``noticed_at`` (version -> wall time it was noticed, owned and
    written by the owner, read here), ``stopping()`` (True once a stop was asked: no new engine is started
    on), ``write_status()`` (write the status file now) and ``on_update(record)`` (None, or called after each
    version reaches an engine group, after the record was added to ``status``).

    Use from the owner's event loop, one round at a time; its blocking work (store reads, critical sections,
    cache trimming) runs in worker threads. A critical section in progress (:attr:`in_critical_section`) is
    shielded from cancellation: the owner must not cancel the round then, only ask it to stop.
    """

    def __init__(self, *, run_id: str, manifests: ManifestSource, source: ShardSource, cache: ShardCache,
                 drivers: Mapping[str, EngineDriver], metrics: DaemonMetrics, status: StatusBoard,
                 engine_check_s: float, newest: Callable[[], int | None], noticed_at: Mapping[int, float],
                 stopping: Callable[[], bool], write_status: Callable[[], None],
                 on_update: Callable[[dict], None] | None = None):
        self.run_id, self.manifests, self.source, self.cache = run_id, manifests, source, cache
        self.drivers, self.metrics, self.status = drivers, metrics, status
        self.engine_check_s = engine_check_s
        self._newest, self._noticed_at, self._stopping = newest, noticed_at, stopping
        self._write_status, self._on_update = write_status, on_update
        self._critical = 0  # critical sections in progress
        self._fetch_s: float | None = None  # the last plan's download time, for update records
        self._fetch_retry_at = 0.0  # after a full cache disk: no downloads before this (monotonic)
        self._disk_full = 0  # full-disk failures in a row

    @property
    def in_critical_section(self) -> bool:
        """True while an engine's critical section runs (cancelling the round now would not stop it)."""
        return self._critical > 0

    async def advance(self, group: list[EngineDriver], cur: int | None) -> None:
        """Move ``group`` (engines at version ``cur``; None: to be rebuilt) towards the newest version: plan,
        fetch, then stage and apply each step (or rebuild each engine), then trim the cache. Leaves each
        driver's ``state``/``error`` saying where it got; an engine's failure is counted, shown and backed off,
        never raised. Raises what the store raises (``StoreError``) and unexpected errors of the fetch;
        cancellation propagates, except into a critical section, which is always finished."""
        plan = await asyncio.to_thread(plan_update, self.manifests, cur, self._newest())
        if plan is None:
            for d in group:
                d.state = "blocked" if cur is not None else "needs rebuild"
            return
        log.debug("run %s: engines %s at %s -> %d via %s (%d bytes)", self.run_id, [d.name for d in group], cur,
                  plan.target, plan.versions, plan.bytes)
        if not await self._fetch(plan):
            return
        if cur is None:
            for d in group:
                if self._stopping():
                    return
                await self._rebuild(d, plan)
        else:
            await self._step_through(group, plan)
        await asyncio.to_thread(self._retain)

    async def _critical_call(self, fn, *args):
        """Run blocking ``fn`` in a thread; cancelling the caller does not interrupt it (see
        :attr:`in_critical_section`)."""
        self._critical += 1
        try:
            return await asyncio.shield(asyncio.to_thread(fn, *args))
        finally:
            self._critical -= 1

    async def _fetch(self, plan: Plan) -> bool:
        """Every shard of the plan into the cache; False on bad or missing data (the version is rejected)
        or a full cache disk (counted, shown in the status, retried after a backoff)."""
        if time.monotonic() < self._fetch_retry_at:
            return False
        t0 = time.perf_counter()
        results = await asyncio.gather(*(self.source.ensure(self.run_id, m) for m in plan.steps),
                                       return_exceptions=True)
        full = None
        for m, r in zip(plan.steps, results):
            if isinstance(r, (IntegrityError, VersionNotFound)):
                self.manifests.reject(m.version, r)
            elif isinstance(r, OSError) and r.errno in (errno.ENOSPC, errno.EDQUOT):
                full = r
            elif isinstance(r, BaseException):
                raise r
        if full is not None:
            self._cache_full(full)
            return False
        if self._disk_full:
            log.warning("cache %s: writes succeed again", self.cache.root)
            self._disk_full = 0
            self.status.set(cache_error=None)
        self._fetch_s = time.perf_counter() - t0
        return not any(isinstance(r, BaseException) for r in results)

    def _cache_full(self, exc: OSError) -> None:
        """The cache disk is full: count it, show it, free what is not pinned, back off before downloading."""
        self._disk_full += 1
        self.metrics.failure("disk_full")
        delay = min(60.0, self.engine_check_s * 2 ** min(self._disk_full, 10))
        self._fetch_retry_at = time.monotonic() + delay
        message = f"cache disk full: {exc}"
        if self._disk_full == 1 or self.status.get("cache_error") != message:
            log.error("cache %s: %s; the engines keep serving their versions; retrying in %.1fs", self.cache.root,
                      exc, delay)
        self.status.set(cache_error=message)
        self._retain()

    async def _heal(self, steps) -> int:
        """Re-hash the cached shards of ``steps`` after an engine refused them; each bad one is removed and
        counted, and fetched again at the next round. Returns how many were bad."""
        forget = getattr(self.source, "forget", None)
        bad = 0
        for m in steps:
            if forget is not None:
                forget(m)
            found = await asyncio.gather(*(asyncio.to_thread(check_cached, self.cache, s, self.metrics)
                                           for s in m.shards))
            bad += found.count("bad")
        return bad

    async def _step_through(self, group: list[EngineDriver], plan: Plan) -> None:
        prev = await asyncio.to_thread(self.manifests.get, plan.current)
        for m in plan.steps:
            group = [d for d in group if d.verified and not d.needs_rebuild and d.reachable and
                     (d.version == prev.version)]
            if not group or self._stopping():
                return
            raw = await asyncio.to_thread(self.manifests.raw, m.version)
            t0 = time.perf_counter()
            for d in group:
                d.state = "staging"
            refused = await stage_group(group, m, raw, self.cache.root)
            if refused:  # stage writes nothing: those engines serve their verified version; the others go on
                for d, exc in refused.items():
                    log.error("engine %s: staging version %d failed: %s: %s", d.name, m.version, type(exc).__name__,
                              exc)
                await self._refused({d: f"staging {m.version}: {exc}" for d, exc in refused.items()}, [m])
                group = [d for d in group if d not in refused]
                if not group:
                    return
            stage_s = time.perf_counter() - t0
            self.metrics.stage_s.observe(stage_s)
            await asyncio.to_thread(points.reached, "stage", m.version)
            record = self._record(m, stage_s)
            for d in group:
                if self._stopping():
                    return  # staged but not applied: harmless, the next stage replaces it
                d.state = "applying"
                try:
                    t = await self._critical_call(d.apply_staged, m, prev)
                except (UpdateFailed, NeedsRebuild) as exc:
                    log.error("%s", exc)
                    d.error, d.state = str(exc), "needs rebuild" if d.needs_rebuild else "serving"
                    self._backoff(d)
                    continue
                except Exception as exc:  # noqa: BLE001 -- unreachable engine or out-of-order call
                    log.error("engine %s: update to version %d failed: %s: %s", d.name, m.version,
                              type(exc).__name__, exc)
                    self.metrics.failure("engine")
                    d.verified, d.error, d.state = False, str(exc), "unknown"
                    continue
                d.state, d.error, d.failures = "serving", None, 0
                record["pause_s"][d.name] = t["pause_s"]
                record["apply_s"][d.name] = t["apply_s"]
                self._applied(d, m, t["pause_s"], t["apply_s"])
            self._finish(record)
            prev = m
            newest = self._newest()
            if newest is not None and newest > plan.target:
                return  # newer versions arrived: re-plan (maybe a shorter way to the newest)

    async def _rebuild(self, d: EngineDriver, plan: Plan) -> None:
        raws = [await asyncio.to_thread(self.manifests.raw, m.version) for m in plan.steps]
        d.state = "rebuilding"
        record = self._record(plan.steps[-1], 0.0, rebuild_from=plan.steps[0].version)
        try:
            t = await self._critical_call(d.rebuild, plan, raws, self.cache.root)
        except RebuildFailed as exc:
            log.error("%s", exc)
            self.metrics.failure("rebuild")
            d.state, d.error = "paused: rebuild failed", str(exc)
            if await self._heal(plan.steps):  # not the same bytes again: they are fetched anew, at once
                log.warning("engine %s: the rebuild met bad cached shards; they are fetched again", d.name)
            else:
                self._backoff(d)
            return
        except Exception as exc:  # noqa: BLE001 -- e.g. the engine went away mid-rebuild
            log.error("engine %s: rebuild failed: %s: %s", d.name, type(exc).__name__, exc)
            self.metrics.failure("engine")
            d.verified, d.needs_rebuild, d.error, d.state = False, True, str(exc), "unknown"
            self._backoff(d)
            return
        self.metrics.count("rebuilds", engine=d.name)
        self.metrics.rebuild_s.observe(t["pause_s"])
        reached = next(m for m in plan.steps if m.version == t["version"])
        if t["refused"]:  # it serves an earlier version of the chain; the rest waits, as a refused stage does
            await self._refused({d: t["refused"]}, plan.steps)
            record = self._record(reached, 0.0, rebuild_from=plan.steps[0].version)
        else:
            d.state, d.error, d.failures = "serving", None, 0
        record["pause_s"][d.name] = t["pause_s"]
        self._applied(d, reached, None, None)
        self._finish(record)

    # ------------------------------------------------------------------------------------- bookkeeping

    async def _refused(self, errors: dict, steps) -> None:
        """Engines (``errors``: driver -> what it said) that refused to stage a version of ``steps`` and serve a
        verified version: counted, the error shown until an update lands; the steps' cached shards re-hashed
        (bad ones are fetched again at once), else each engine backs off (the same bytes would be refused)."""
        for d, error in errors.items():
            self.metrics.failure("apply")
            d.state, d.error = "serving", error
        if await self._heal(steps):
            log.warning("run %s: versions %s had bad cached shards; they are fetched again", self.run_id,
                        [m.version for m in steps])
        else:
            for d in errors:
                self._backoff(d)

    def _backoff(self, d: EngineDriver) -> None:
        d.failures += 1
        d.retry_at = time.monotonic() + min(60.0, self.engine_check_s * 2 ** d.failures)

    def _record(self, m: mf.Manifest, stage_s: float, **extra) -> dict:
        noticed = min((t for v, t in self._noticed_at.items() if v >= m.version), default=None)
        return {"version": m.version, "kind": m.kind, "step": m.step, "bytes": m.total_bytes,
                "full_bytes": sum(t.nbytes for t in m.tensors), "created_at": m.created_at,
                "noticed_at": noticed, "download_s": self._fetch_s, "stage_s": stage_s,
                "pause_s": {}, "apply_s": {}, "done_at": None, **extra}

    def _applied(self, d: EngineDriver, m: mf.Manifest, pause_s: float | None, apply_s: float | None) -> None:
        """Count engine ``d`` serving ``m``; ``pause_s``/``apply_s`` None for a rebuild (its own histogram: a
        restart's pause and lag are not an update's)."""
        self.metrics.count("versions_applied", engine=d.name)
        if pause_s is not None:
            self.metrics.pause_s.observe(pause_s)
            lag = time.time() - m.created_datetime.timestamp()
            if lag >= 0:
                self.metrics.update_lag_s.observe(lag)
            self.status.engine(d.name, last_pause_s=pause_s)
        if apply_s is not None:
            self.metrics.apply_s.observe(apply_s)
        log.debug("engine %s serves version %d (paused %ss)", d.name, m.version, pause_s)

    def _finish(self, record: dict) -> None:
        pauses = record["pause_s"]
        if pauses:  # the one INFO line of an update
            how = (f"rebuilt from full version {record['rebuild_from']}" if record.get("rebuild_from") is not None
                   else f"{record['kind']} of {record['bytes'] / 1e3:.1f} kB")
            lag = time.time() - _created(record["created_at"])
            log.info("run %s: version %d (%s) serving on %s; pause %s ms; %.2f s after it was published",
                     self.run_id, record["version"], how, ", ".join(pauses),
                     "/".join(f"{p * 1e3:.1f}" for p in pauses.values()), lag)
        record["done_at"] = time.time()
        self.status.add_update(record)
        self._write_status()
        if self._on_update is not None:
            self._on_update(record)

    def _retain(self) -> None:
        """Trim the cache, pinning the chains (full version + deltas) of every engine's version and of the
        newest version: what a restart or a rebuild needs."""
        pinned, oldest = set(), None
        for v in {d.version for d in self.drivers.values() if d.version is not None} | {self._newest()}:
            if v is None:
                continue
            try:
                path = walk_back(self.manifests, v)
            except SyncdError:
                path = None
            for m in path or ():
                pinned.update(s.sha256 for s in m.shards)
            if path:
                oldest = path[0].version if oldest is None else min(oldest, path[0].version)
        self.cache.evict(pinned)
        if oldest is not None:
            self.manifests.forget_below(oldest)
