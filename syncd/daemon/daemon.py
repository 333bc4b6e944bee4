"""``NodeDaemon``: keeps every engine on a node on the newest verified version of one run.

The loop (asyncio; store and engine calls run in worker threads):

1. *Notice*: the poller (or an external ``on_version_ready(manifest)`` callback, e.g. from the cluster
   layer) reports the newest version number; the daemon wakes.
2. *Check engines*: each engine's version is asked. An engine seen for the first time, or reporting a
   version the daemon did not set (restarted), has its checksums compared with that version's manifest;
   if they match the daemon continues from there (and resumes it, in case a previous daemon died while it
   was paused), else the engine is rebuilt.
3. *Plan* (``planner``): delta chain or newer full version, whichever moves fewer bytes; around rejected
   versions. *Fetch* every shard of the plan into the node cache (``ShardSource``), verified.
4. *Stage* each version on the engines while they serve, then, one engine at a time (the others keep
   serving), the critical section ``pause -> apply -> checksum check -> resume`` (``driver``).
   Engines with unknown weights are rebuilt instead (``recovery``), paused throughout.
5. *Retain*: the cache is trimmed to its bound, keeping what a restart needs.

SIGTERM/SIGINT: a download or staging in progress is abandoned (the cache holds only complete shards, and a
staged update is harmless), an engine's critical section is always finished; then the companions (e.g. the
cluster node, :mod:`syncd.daemon.cluster`) are stopped and the daemon exits.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from typing import Mapping

from syncd import manifest as mf
from syncd.cache import ShardCache
from syncd.daemon import testhooks
from syncd.daemon.config import DaemonConfig
from syncd.daemon.driver import EngineDriver, NeedsRebuild, UpdateFailed
from syncd.daemon.fetcher import ShardSource, StoreShardSource
from syncd.daemon.manifests import ManifestSource
from syncd.daemon.metrics import DaemonMetrics
from syncd.daemon.planner import Plan, plan_update, walk_back
from syncd.daemon.poller import Poller
from syncd.daemon.recovery import RebuildFailed, rebuild_engine
from syncd.daemon.stager import stage_group
from syncd.daemon.status import StatusBoard, default_status_file
from syncd.errors import (IntegrityError, ManifestError, ManifestMismatch, StoreError, SyncdError,
                          VersionNotFound)

log = logging.getLogger(__name__)


class NodeDaemon:
    """The node daemon for ``config.run_id``.

    ``adapters``: in-process engines by name (``engine.Adapter``), in addition to ``config.engines``
    (engine processes, reached through ``engine.control.RemoteAdapter``). ``store``: a
    :class:`~syncd.store.Store` (None: opened from ``config.store_url``). ``source``: the
    :class:`ShardSource` (None: downloads from the store). ``poll=False``: versions arrive only through
    :meth:`on_version_ready`. ``signing_key``: as in :func:`syncd.signing.resolve_key` (None: from the
    environment). ``on_update(record)``: called (on the event loop) after each version reaches an engine
    group, with the record also added to the status file. Companions (:meth:`attach`) run in the daemon's
    loop alongside it. Use from one event loop.
    """

    def __init__(self, config: DaemonConfig, *, adapters: Mapping[str, object] | None = None, store=None,
                 cache: ShardCache | None = None, source: ShardSource | None = None, poll: bool = True,
                 signing_key=None, metrics: DaemonMetrics | None = None, on_update=None):
        from engine.control import RemoteAdapter
        from syncd.signing import resolve_key
        from syncd.store import Store

        self.config = config
        self.run_id = mf.check_run_id(config.run_id)
        if store is None and (poll or source is None):
            store = Store(config.store_url, endpoint=config.store_endpoint, options=config.store_options)
        self.store = store
        self.cache = cache or ShardCache(config.cache_dir, max_bytes=config.cache_max_bytes)
        self.key = resolve_key(signing_key)
        if self.key is None:
            log.warning("no signing key configured (SYNCD_SIGNING_KEY): manifest signatures are NOT verified")
        self.metrics = metrics or DaemonMetrics()
        self.manifests = ManifestSource(self.run_id, store=store, cache=self.cache, key=self.key,
                                        metrics=self.metrics, retry_failed_s=config.retry_failed_s)
        self.source = source or StoreShardSource(store, self.cache, concurrency=config.download_concurrency,
                                                 metrics=self.metrics)
        engines = dict(adapters or {})
        for spec in config.engines:
            if spec.name in engines:
                raise ValueError(f"engine name {spec.name!r} is used twice")
            engines[spec.name] = RemoteAdapter(spec.url)
        if not engines:
            raise ValueError("the daemon needs at least one engine (--engine URL)")
        self.drivers = {name: EngineDriver(name, a, metrics=self.metrics) for name, a in engines.items()}
        status_path = config.status_file or default_status_file(self.cache.root, self.run_id)
        self.status = StatusBoard(status_path, run_id=self.run_id, store=getattr(store, "url", None),
                                  cache_dir=str(self.cache.root), metrics_url=None)
        for name, spec_url in ((n, getattr(a, "base_url", "in-process")) for n, a in engines.items()):
            self.status.engine(name, url=spec_url, version=None, lag=None, state="unknown", error=None,
                               applied=0, last_pause_s=None)
        self.poll, self.on_update = poll, on_update
        self.newest: int | None = None
        self.noticed_at: dict[int, float] = {}
        self.metrics_url: str | None = None
        self._stop: asyncio.Event | None = None
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._critical = 0
        self._fetch_s: float | None = None  # the last plan's download time, for update records
        self._companions: list = []

    def attach(self, companion) -> None:
        """Run ``companion`` in the daemon's loop (call before :meth:`run`): ``await companion.start()``
        once the daemon is up (its metrics served, before the first round; an exception there ends
        :meth:`run` with it), ``companion.status() -> dict`` merged into the status file on every write,
        and ``await companion.stop()`` after the loop ended (so never during an engine's critical
        section; also after a failed ``start``). E.g. :class:`syncd.daemon.cluster.ClusterLink`."""
        self._companions.append(companion)

    # ------------------------------------------------------------------------------------- control

    def _candidate(self, version: int) -> None:
        if self.newest is None or version > self.newest:
            self.newest = version
            self.noticed_at.setdefault(version, time.time())
            self.metrics.newest_version.set(version)
            self.status.set(newest_version=version)
            log.info("run %s: version %d noticed", self.run_id, version)
            if self._wake is not None:
                self._wake.set()

    async def on_version_ready(self, manifest) -> None:
        """External delivery (cluster layer): a version whose shards are all in the node cache (or will be,
        through the configured ``ShardSource``). ``manifest`` is the manifest's exact bytes (preferred: they
        are verified here and kept), or a parsed :class:`~syncd.manifest.Manifest`, whose bytes are then
        read from the node cache or the store and must hash to its ``digest``. Raises
        :class:`~syncd.errors.ManifestError` if it does not verify."""
        if isinstance(manifest, mf.Manifest):
            m = await asyncio.to_thread(self.manifests.get, manifest.version)
            if manifest.digest is not None and m.digest != manifest.digest:
                raise ManifestMismatch(f"run {self.run_id} version {manifest.version}: the delivered manifest "
                                       "differs from the one in the cache/store")
        else:
            m = await asyncio.to_thread(self.manifests.add, bytes(manifest))
        self._candidate(m.version)

    def request_stop(self) -> None:
        """Stop soon: abandon a download or staging in progress, finish an engine's critical section."""
        if self._stop is None or self._stop.is_set():
            return
        log.warning("run %s: stopping (%s)", self.run_id,
                    "after the engine update in progress" if self._critical else "now")
        self._stop.set()
        if self._task is not None and not self._critical:
            self._task.cancel()

    async def _critical_call(self, fn, *args):
        """Run blocking ``fn`` in a thread; a stop request waits for it instead of cancelling it."""
        self._critical += 1
        try:
            return await asyncio.shield(asyncio.to_thread(fn, *args))
        finally:
            self._critical -= 1

    def _stopping(self) -> bool:
        return self._stop is not None and self._stop.is_set()

    # ------------------------------------------------------------------------------------- main loop

    async def run(self) -> None:
        """Run until :meth:`request_stop` (or SIGTERM/SIGINT when on the main thread)."""
        loop = asyncio.get_running_loop()
        self._stop, self._wake = asyncio.Event(), asyncio.Event()
        if self.newest is not None:
            self._wake.set()
        handlers = threading.current_thread() is threading.main_thread()
        if handlers:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.request_stop)
        self.cache.clean_tmp()
        if self.config.metrics_port is not None:
            self.metrics_url = self.metrics.serve(self.config.metrics_port, self.config.metrics_addr)
        self.status.set(state="running", metrics_url=self.metrics_url)
        self._write_status(force=True)
        poller = None
        started = []
        try:
            for companion in self._companions:
                started.append(companion)  # stopped in any case: stop() must be safe after a failed start()
                await companion.start()
            if self.poll:
                poller = Poller(self.store, self.run_id, interval_s=self.config.poll_interval_s,
                                jitter=self.config.poll_jitter, backoff_max_s=self.config.backoff_max_s,
                                list_every_s=self.config.list_every_s, on_candidate=self._candidate,
                                on_error=self._poll_error, on_ok=lambda: self.status.set(store_error=None))
                poller_task = asyncio.ensure_future(poller.run(self._stop))
            while not self._stop.is_set():
                self._task = asyncio.ensure_future(self._reconcile())
                try:
                    await self._task
                except asyncio.CancelledError:
                    if not self._stop.is_set():
                        raise
                except StoreError as exc:
                    self.metrics.failure("store")
                    log.warning("run %s: store error while updating engines: %s", self.run_id, exc)
                    self.status.set(store_error=str(exc))
                except Exception:  # noqa: BLE001 -- the daemon outlives any single failed round
                    log.exception("run %s: update round failed", self.run_id)
                finally:
                    self._task = None
                self._write_status(force=True)
                if self._stop.is_set():
                    break
                try:
                    await asyncio.wait_for(self._wake.wait(), self.config.engine_check_s)
                except asyncio.TimeoutError:
                    pass
        finally:
            self._stop.set()
            if poller is not None:
                await asyncio.gather(poller_task, return_exceptions=True)
            for companion in reversed(started):
                try:
                    await companion.stop()
                except Exception:  # noqa: BLE001 -- the daemon still stops cleanly
                    log.exception("run %s: stopping %r failed", self.run_id, companion)
            if handlers:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.remove_signal_handler(sig)
            self.status.set(state="stopped")
            self._write_status(force=True)
            self.metrics.close()
            log.info("run %s: daemon stopped", self.run_id)

    def _poll_error(self, exc: BaseException) -> None:
        self.metrics.count("poll_errors")
        self.status.set(store_error=f"{type(exc).__name__}: {exc}")
        self._write_status()

    def _write_status(self, force: bool = False) -> None:
        for name, d in self.drivers.items():
            lag = None if self.newest is None or d.version is None else self.newest - d.version
            self.status.engine(name, version=d.version, lag=lag, state=d.state, error=d.error,
                               applied=len(d.applied))
            self.metrics.engine_version.labels(name).set(-1 if d.version is None else d.version)
            if lag is not None:
                self.metrics.engine_lag.labels(name).set(lag)
        for companion in self._companions:
            fields = companion.status()
            if fields:
                self.status.set(**fields)
        self.status.write(self.metrics.totals, force=force)

    # ------------------------------------------------------------------------------------- one round

    async def _reconcile(self) -> None:
        self._wake.clear()
        await asyncio.gather(*(asyncio.to_thread(self._refresh, d) for d in self.drivers.values()))
        self._write_status()
        while not self._stopping() and self.newest is not None:
            now = time.monotonic()
            todo = [d for d in self.drivers.values() if d.reachable and d.retry_at <= now and
                    (d.needs_rebuild or (d.verified and (d.version is None or d.version < self.newest)))]
            if not todo:
                return
            before = {d.name: (d.version, d.needs_rebuild) for d in todo}
            cur = None if todo[0].needs_rebuild else todo[0].version
            group = [d for d in todo if (None if d.needs_rebuild else d.version) == cur]
            await self._advance(group, cur)
            if all(before[d.name] == (d.version, d.needs_rebuild) for d in todo):
                return  # no progress this round: wait for a new version, an engine change, or a retry time

    def _refresh(self, d: EngineDriver) -> None:
        """Blocking: ask the engine its version; verify it when it is new or unexpected."""
        from engine.control import EngineUnreachable

        try:
            v = d.adapter.version
        except (EngineUnreachable, OSError) as exc:
            if d.reachable:
                log.warning("engine %s is unreachable: %s", d.name, exc)
                self.metrics.failure("engine")
            d.reachable, d.verified, d.state, d.error = False, False, "unreachable", str(exc)
            d.forget_specs()
            return
        if not d.reachable:
            log.info("engine %s answers again (version %s)", d.name, v)
        d.reachable = True
        if d.verified and v == d.version and not d.needs_rebuild:
            if d.state in ("unknown", "unreachable"):
                d.state, d.error = "serving", None
            return
        if d.verified or d.version is not None:
            log.warning("engine %s reports version %s, expected %s (restarted?): checking its weights", d.name, v,
                        d.version)
        d.verified = False
        if v is None:
            d.version, d.needs_rebuild, d.state = None, True, "needs rebuild"
            return
        try:
            m = self.manifests.get(v)
            ok = not d.mismatches(m)
        except (VersionNotFound, ManifestError) as exc:
            log.warning("engine %s holds version %d, which cannot be verified (%s): rebuilding", d.name, v, exc)
            ok = False
        except StoreError as exc:
            log.warning("engine %s: cannot read version %d's manifest now: %s", d.name, v, exc)
            return
        if ok:
            d.version, d.verified, d.needs_rebuild, d.state, d.error = v, True, False, "serving", None
            d.applied = {v}
            d.resume()  # a daemon that died mid-update may have left it paused on these (verified) weights
            log.info("engine %s verified at version %d", d.name, v)
        else:
            d.version, d.needs_rebuild, d.state = None, True, "needs rebuild"

    async def _advance(self, group: list[EngineDriver], cur: int | None) -> None:
        """Move ``group`` (engines at version ``cur``; None: to be rebuilt) towards the newest version."""
        plan = await asyncio.to_thread(plan_update, self.manifests, cur, self.newest)
        if plan is None:
            for d in group:
                d.state = "blocked" if cur is not None else "needs rebuild"
            return
        log.info("run %s: engines %s at %s -> %d via %s (%d bytes)", self.run_id, [d.name for d in group], cur,
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

    async def _fetch(self, plan: Plan) -> bool:
        """Every shard of the plan into the cache; False (version rejected) on bad or missing data."""
        t0 = time.perf_counter()
        results = await asyncio.gather(*(self.source.ensure(self.run_id, m) for m in plan.steps),
                                       return_exceptions=True)
        for m, r in zip(plan.steps, results):
            if isinstance(r, (IntegrityError, VersionNotFound)):
                self.manifests.reject(m.version, r)
            elif isinstance(r, BaseException):
                raise r
        self._fetch_s = time.perf_counter() - t0
        return not any(isinstance(r, BaseException) for r in results)

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
            try:
                await stage_group(group, raw, self.cache.root)
            except Exception as exc:  # noqa: BLE001 -- the engines are untouched: re-check them next round
                log.error("run %s: staging version %d failed: %s: %s", self.run_id, m.version, type(exc).__name__, exc)
                self.metrics.failure("apply")
                for d in group:
                    d.verified, d.state, d.error = False, "serving", f"staging {m.version}: {exc}"
                return
            stage_s = time.perf_counter() - t0
            self.metrics.stage_s.observe(stage_s)
            await asyncio.to_thread(testhooks.reached, "stage", m.version)
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
            if self.newest is not None and self.newest > plan.target:
                return  # newer versions arrived: re-plan (maybe a shorter way to the newest)

    async def _rebuild(self, d: EngineDriver, plan: Plan) -> None:
        raws = [await asyncio.to_thread(self.manifests.raw, m.version) for m in plan.steps]
        d.state = "rebuilding"
        record = self._record(plan.steps[-1], 0.0, rebuild_from=plan.steps[0].version)
        try:
            t = await self._critical_call(rebuild_engine, d, plan, raws, self.cache.root)
        except RebuildFailed as exc:
            log.error("%s", exc)
            self.metrics.failure("rebuild")
            d.state, d.error = "paused: rebuild failed", str(exc)
            self._backoff(d)
            return
        except Exception as exc:  # noqa: BLE001 -- e.g. the engine went away mid-rebuild
            log.error("engine %s: rebuild failed: %s: %s", d.name, type(exc).__name__, exc)
            self.metrics.failure("engine")
            d.verified, d.needs_rebuild, d.error, d.state = False, True, str(exc), "unknown"
            self._backoff(d)
            return
        self.metrics.count("rebuilds", engine=d.name)
        d.state, d.error, d.failures = "serving", None, 0
        record["pause_s"][d.name] = t["pause_s"]
        self._applied(d, plan.steps[-1], t["pause_s"], None)
        self._finish(record)

    # ------------------------------------------------------------------------------------- bookkeeping

    def _backoff(self, d: EngineDriver) -> None:
        d.failures += 1
        d.retry_at = time.monotonic() + min(60.0, self.config.engine_check_s * 2 ** d.failures)

    def _record(self, m: mf.Manifest, stage_s: float, **extra) -> dict:
        noticed = min((t for v, t in self.noticed_at.items() if v >= m.version), default=None)
        return {"version": m.version, "kind": m.kind, "step": m.step, "bytes": m.total_bytes,
                "full_bytes": sum(t.nbytes for t in m.tensors), "created_at": m.created_at,
                "noticed_at": noticed, "download_s": self._fetch_s, "stage_s": stage_s,
                "pause_s": {}, "apply_s": {}, "done_at": None, **extra}

    def _applied(self, d: EngineDriver, m: mf.Manifest, pause_s: float, apply_s: float | None) -> None:
        self.metrics.count("versions_applied", engine=d.name)
        self.metrics.pause_s.observe(pause_s)
        if apply_s is not None:
            self.metrics.apply_s.observe(apply_s)
        lag = time.time() - m.created_datetime.timestamp()
        if lag >= 0:
            self.metrics.update_lag_s.observe(lag)
        self.status.engine(d.name, last_pause_s=pause_s)
        log.info("engine %s serves version %d (paused %.3fs)", d.name, m.version, pause_s)

    def _finish(self, record: dict) -> None:
        record["done_at"] = time.time()
        self.status.add_update(record)
        self._write_status(force=True)
        if self.on_update is not None:
            self.on_update(record)

    def _retain(self) -> None:
        """Trim the cache, pinning the chains (full version + deltas) of every engine's version and of the
        newest version: what a restart or a rebuild needs."""
        pinned, oldest = set(), None
        for v in {d.version for d in self.drivers.values() if d.version is not None} | {self.newest}:
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
