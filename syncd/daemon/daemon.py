"""``NodeDaemon``: keeps every engine on a node on the newest verified version of one run.

The loop (asyncio; store and engine calls run in worker threads):

1. *Notice*: the poller (or an external ``on_version_ready(manifest)`` callback, e.g. from the cluster
   layer) reports the newest *valid* version (its manifest read, parsed and verified; ``syncd.newest``);
   the daemon wakes. A run without versions is reported at once ("unknown run", with the runs there are).
2. *Check engines* (``EngineDriver.refresh``, every ``engine_check_s``): each engine's lease is renewed
   and its control state read. An engine seen for the first time, reporting a version the daemon did not
   set (restarted), holding another run's weights, or whose weights were written by someone else (its
   write counter moved) has its checksums compared with that version's manifest: if they match the daemon
   continues from there (and resumes it, in case a previous daemon died while it was paused), else the
   engine is rebuilt. A healthy engine has a slice of its weights checksummed every ``engine_scrub_s`` (the
   scrub: a call into the engine, so not at every check). An engine whose lease another daemon holds is left
   alone and shown as such.
3. *Plan* (``planner``): delta chain or newer full version, whichever moves fewer bytes; around rejected
   versions. *Fetch*, *stage*, *apply*, *rebuild*, *retain*: :mod:`syncd.daemon.updates`.

Long-lived tasks run under a :class:`syncd.supervise.Supervisor` (any exception is logged, counted in
``syncd_failures_total{kind}`` with the task's name as the kind, shown under ``tasks`` in the status file,
and the task restarted after a backoff); an update round that fails unexpectedly is logged, counted
(``kind="round"``) and retried.

SIGTERM/SIGINT: a download or staging in progress is abandoned (the cache holds only complete shards, and a
staged update is harmless), an engine's critical section is always finished; then the engines' leases are
released, the companions (e.g. the cluster node, :mod:`syncd.daemon.cluster`) are stopped and the daemon
exits.
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
from syncd.daemon.config import DaemonConfig
from syncd.daemon.driver import EngineDriver
from syncd.daemon.fetcher import ShardSource, StoreShardSource
from syncd.daemon.metrics import DaemonMetrics
from syncd.daemon.poller import Poller
from syncd.daemon.status import StatusBoard, default_status_file
from syncd.daemon.updates import UpdatePath
from syncd.errors import ManifestMismatch, StoreError
from syncd.manifest_source import ManifestSource
from syncd.supervise import Supervisor

log = logging.getLogger(__name__)


class NodeDaemon:
    """The node daemon for ``config.run_id``.

    ``adapters``: in-process engines by name (any ``syncd.engines.Adapter``; each driven through an
    :class:`~syncd.engines.local.InProcessLink`), in addition to ``config.engines`` (engine processes, driven
    through a :class:`~syncd.engines.client.RemoteAdapter`): one kind of link for both. ``store``: a
    :class:`~syncd.store.Store` (None: opened from ``config.store_url``). ``source``: the
    :class:`ShardSource` (None: downloads from the store). ``poll=False``: versions arrive only through
    :meth:`on_version_ready`. ``signing_key``: as in :func:`syncd.signing.resolve_key` (None: from the
    environment). ``on_update(record)``: called (on the event loop) after each version reaches an engine
    group, with the record also added to the status file. Companions (:meth:`attach`) run in the daemon's
    loop alongside it. Use from one event loop.

    The daemon holds the engines' drivers (:class:`~syncd.daemon.driver.EngineDriver`), chooses each round
    which group of engines moves from which version, and hands the moving to its
    :class:`~syncd.daemon.updates.UpdatePath` (fetch, stage, apply, rebuild, cache trimming).
    """

    def __init__(self, config: DaemonConfig, *, adapters: Mapping[str, object] | None = None, store=None,
                 cache: ShardCache | None = None, source: ShardSource | None = None, poll: bool = True,
                 signing_key=None, metrics: DaemonMetrics | None = None, on_update=None):
        from syncd.engines.client import RemoteAdapter
        from syncd.engines.local import InProcessLink
        from syncd.signing import ENV_KEY, ENV_KEY_FILE, resolve_policy
        from syncd.store import Store

        self.config = config
        self.run_id = mf.check_run_id(config.run_id)
        if store is None and (poll or source is None):  # a reader: never creates a missing file:// store
            store = Store(config.store_url, endpoint=config.store_endpoint, options=config.store_options,
                          create=False)
        self.store = store
        self.cache = cache or ShardCache(config.cache_dir, max_bytes=config.cache_max_bytes)
        self.key, self.allow_unsigned = resolve_policy(signing_key)
        if self.key is None:
            log.warning("no signing key configured (%s or %s): manifest signatures are NOT verified; signed "
                        "manifests are %s", ENV_KEY, ENV_KEY_FILE,
                        "read unchecked (--allow-unsigned)" if self.allow_unsigned else "refused")
        self.metrics = metrics or DaemonMetrics()
        self.manifests = ManifestSource(self.run_id, store=store, cache=self.cache, key=self.key,
                                        metrics=self.metrics, retry_failed_s=config.retry_failed_s,
                                        allow_unsigned=self.allow_unsigned)
        engines = {name: InProcessLink(a) for name, a in (adapters or {}).items()}
        for spec in config.engines:
            if spec.name in engines:
                raise ValueError(f"engine name {spec.name!r} is used twice")
            engines[spec.name] = RemoteAdapter(spec.url, run_id=self.run_id, lease_s=config.engine_lease_s,
                                               token_file=config.engine_token_file)
        if not engines:
            raise ValueError("the daemon needs at least one engine (--engine URL)")
        self.drivers = {name: EngineDriver(name, a, metrics=self.metrics) for name, a in engines.items()}
        status_path = config.status_file or default_status_file(self.cache.root, self.run_id)
        self.status = StatusBoard(status_path, run_id=self.run_id, store=getattr(store, "url", None),
                                  cache_dir=str(self.cache.root), metrics_url=None)
        for name, link in engines.items():
            self.status.engine(name, url=link.url, version=None, lag=None, state="unknown", error=None,
                               applied=0, last_pause_s=None)
        self.poll = poll
        self.newest: int | None = None
        self.noticed_at: dict[int, float] = {}
        self.metrics_url: str | None = None
        self._stop: asyncio.Event | None = None
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._companions: list = []
        self._status_due: asyncio.TimerHandle | None = None  # the write of a change that came too soon after one
        self.supervisor = Supervisor(f"daemon of run {self.run_id}", on_failure=self._task_failed,
                                     backoff_s=config.poll_interval_s, max_backoff_s=config.backoff_max_s)
        source = source or StoreShardSource(store, self.cache, concurrency=config.download_concurrency,
                                            metrics=self.metrics)
        self._updates = UpdatePath(run_id=self.run_id, manifests=self.manifests, source=source, cache=self.cache,
                                   drivers=self.drivers, metrics=self.metrics, status=self.status,
                                   engine_check_s=config.engine_check_s, newest=lambda: self.newest,
                                   noticed_at=self.noticed_at, stopping=self._stopping,
                                   write_status=lambda: self._write_status(force=True), on_update=on_update)

    @property
    def source(self) -> ShardSource:
        """The :class:`ShardSource` the updates fetch with; may be replaced before :meth:`run` (or between
        rounds, from the daemon's loop)."""
        return self._updates.source

    @source.setter
    def source(self, source: ShardSource) -> None:
        self._updates.source = source

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
            log.debug("run %s: version %d noticed", self.run_id, version)
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
        log.info("run %s: stopping (%s)", self.run_id,
                 "after the engine update in progress" if self._updates.in_critical_section else "now")
        self.supervisor.stopping = True  # a task that ends now is stopping, not failing
        self._stop.set()
        self._wake.set()  # the wait between rounds ends too
        if self._task is not None and not self._updates.in_critical_section:
            self._task.cancel()

    def _stopping(self) -> bool:
        return self._stop is not None and self._stop.is_set()

    # ------------------------------------------------------------------------------------- main loop

    async def run(self) -> None:
        """Run until :meth:`request_stop` (or SIGTERM/SIGINT when on the main thread)."""
        loop = asyncio.get_running_loop()
        self._stop, self._wake = asyncio.Event(), asyncio.Event()
        if self.newest is not None:
            self._wake.set()
        self.status.claim(self.cache.root)  # one daemon per cache directory and status file (DaemonLockHeld)
        handlers = threading.current_thread() is threading.main_thread()
        if handlers:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.request_stop)
        self.cache.clean_tmp()
        if self.config.metrics_port is not None:
            try:
                self.metrics_url = self.metrics.serve(self.config.metrics_port, self.config.metrics_addr)
            except BaseException:
                self.status.release()
                raise
        self.status.set(state="running", metrics_url=self.metrics_url)
        self._write_status(force=True)
        poller = None
        started = []
        try:
            for companion in self._companions:
                started.append(companion)  # stopped in any case: stop() must be safe after a failed start()
                await companion.start()
            if self.poll:
                poller = Poller(self.store, self.run_id, read=self.manifests.get,
                                interval_s=self.config.poll_interval_s, jitter=self.config.poll_jitter,
                                backoff_max_s=self.config.backoff_max_s, list_every_s=self.config.list_every_s,
                                retry_s=self.config.retry_failed_s, on_candidate=self._candidate,
                                on_error=self._poll_error, on_ok=self._poll_ok)
                self.supervisor.spawn("poller", lambda: poller.run(self._stop), kind="poller")
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
                except Exception as exc:  # noqa: BLE001 -- the daemon outlives any single failed round
                    self.metrics.failure("round")
                    log.exception("run %s: update round failed", self.run_id)
                    self.status.set(round_error=f"{type(exc).__name__}: {exc}")
                else:
                    self.status.set(round_error=None)
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
            self.supervisor.stopping = True
            self._stop.set()
            await self.supervisor.stop()
            await asyncio.gather(*(asyncio.to_thread(d.release) for d in self.drivers.values()))
            for companion in reversed(started):
                try:
                    await companion.stop()
                except Exception:  # noqa: BLE001 -- the daemon still stops cleanly
                    log.exception("run %s: stopping %r failed", self.run_id, companion)
            if handlers:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.remove_signal_handler(sig)
            self.status.set(state="stopped")
            if self._status_due is not None:
                self._status_due.cancel()
                self._status_due = None
            self._write_status(force=True)
            self.status.release()
            self.metrics.close()
            log.info("run %s: daemon stopped", self.run_id)

    def _poll_error(self, exc: BaseException) -> None:
        self.metrics.count("poll_errors")
        self.status.set(store_error=f"{type(exc).__name__}: {exc}")
        self._write_status()

    def _poll_ok(self, missing_run: str | None) -> None:
        """After a successful poll: ``missing_run`` says why the run has no versions (None: it has some)."""
        was = self.status.get("run_error")
        if missing_run != was:
            if missing_run:
                log.error("%s", missing_run)
            elif was:
                log.warning("run %s: versions appeared in the store", self.run_id)
        before = (self.status.get("store_error"), was, self.status.get("state"))
        self.status.set(store_error=None, run_error=missing_run)
        if not self._stopping():
            self.status.set(state="unknown run" if missing_run else "running")
        if (self.status.get("store_error"), missing_run, self.status.get("state")) != before:
            self._write_status()

    def _task_failed(self, kind: str) -> None:
        self.metrics.failure(kind)
        self._write_status(force=True)

    def _write_status(self, force: bool = False) -> None:
        for name, d in self.drivers.items():
            lag = None if self.newest is None or d.version is None else self.newest - d.version
            self.status.engine(name, version=d.version, lag=lag, state=d.state, error=d.error,
                               applied=len(d.applied))
            self.metrics.engine(name, d.version, lag)
        for companion in self._companions:
            fields = companion.status()
            if fields:
                self.status.set(**fields)
        self.status.set(tasks=self.supervisor.health())
        if self.status.write(self.metrics.totals, force=force) or self._status_due is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not on the daemon's loop: the next round writes it
            return
        self._status_due = loop.call_later(self.status.min_interval_s, self._write_due_status)

    def _write_due_status(self) -> None:
        self._status_due = None
        self._write_status(force=True)

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
            await self._updates.advance(group, cur)
            if all(before[d.name] == (d.version, d.needs_rebuild) for d in todo):
                return  # no progress this round: wait for a new version, an engine change, or a retry time

    def _refresh(self, d: EngineDriver) -> None:
        """Blocking: one engine check (lease, state, verification or scrub; :meth:`EngineDriver.refresh`)."""
        d.refresh(self.manifests, run_id=self.run_id, scrub_bytes=self.config.engine_scrub_bytes,
                  scrub_every_s=self.config.engine_scrub_s)
