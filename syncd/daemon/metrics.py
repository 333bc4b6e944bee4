"""Prometheus metrics of the node daemon (``prometheus_client``, one registry per daemon).

Names follow the Prometheus conventions (base unit as a suffix, ``_total`` on counters; the table, with a
Grafana dashboard, is ``docs/metrics.md``): ``syncd_build_info{version,python}``, ``engine_version{engine}``
and ``engine_lag_versions{engine}`` (no series while an engine's version is unknown), ``newest_version``
(NaN until a version is seen), ``fetched_bytes_total``, ``fetched_shards_total``,
``versions_applied_total{engine}``, ``rebuilds_total{engine}``, ``failures_total{kind}`` (kinds:
:data:`FAILURE_KINDS`; ``poller`` counts restarts of that supervised task, ``disk_full`` a cache write that
found no space, ``unexpected_write`` engine weights written behind the daemon's back, ``lease`` an engine
held by another controller), ``rejected_versions_total{reason}``, ``poll_errors_total``,
``cache_corrupt_total``, and histograms ``download_seconds``, ``stage_seconds``, ``pause_seconds`` and
``apply_seconds`` (live updates of a serving engine), ``rebuild_seconds`` (an engine rebuilt from a full
version: a restart, not an update) and ``update_lag_seconds`` (manifest written to an engine serving it, on the
trainer's clock; live updates only). Renamed in 0.1, the old names are exported too until 0.2
(:data:`DEPRECATED`). :attr:`DaemonMetrics.totals` keeps the counters in plain numbers too (for the status
file). In cluster mode :mod:`syncd.daemon.cluster` adds ``syncd_cluster_*`` to the same registry (a collector
over the cluster node's counters). Thread-safe.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter as _Tally

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest, start_http_server

from syncd.supervise import failures_counter

log = logging.getLogger(__name__)

FAILURE_KINDS = ("store", "signature", "manifest", "integrity", "apply", "checksum", "engine", "rebuild", "cache",
                 "disk_full", "lease", "unexpected_write", "poller", "round", "cluster_status")
#: old metric name -> the name that replaces it; both are exported until 0.2
DEPRECATED = {"syncd_bytes_fetched_total": "syncd_fetched_bytes_total",
              "syncd_shards_fetched_total": "syncd_fetched_shards_total"}
_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class DaemonMetrics:
    """The daemon's metrics in their own registry; :meth:`serve` exposes them over HTTP."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.build_info = Info("syncd_build", "The syncd release and Python of this daemon", registry=r)
        self.build_info.info(_build())
        self.engine_version = Gauge("syncd_engine_version", "Weight version an engine serves (absent: unknown)",
                                    ["engine"], registry=r)
        self.newest_version = Gauge("syncd_newest_version", "Newest version of the run seen in the store (NaN: "
                                    "none yet)", registry=r)
        self.newest_version.set(float("nan"))
        self.engine_lag = Gauge("syncd_engine_lag_versions", "Versions an engine is behind the newest (absent: "
                                "unknown)", ["engine"], registry=r)
        self.fetched_bytes = Counter("syncd_fetched_bytes", "Shard bytes downloaded from the store", registry=r)
        self.fetched_shards = Counter("syncd_fetched_shards", "Shards downloaded from the store", registry=r)
        self._old = {"fetched_bytes": Counter("syncd_bytes_fetched", "Deprecated (until 0.2): "
                                              "syncd_fetched_bytes_total", registry=r),
                     "fetched_shards": Counter("syncd_shards_fetched", "Deprecated (until 0.2): "
                                               "syncd_fetched_shards_total", registry=r)}
        self.versions_applied = Counter("syncd_versions_applied", "Versions applied to an engine", ["engine"],
                                        registry=r)
        self.rebuilds = Counter("syncd_rebuilds", "Engine weights rebuilt from a full version", ["engine"],
                                registry=r)
        self.failures = failures_counter(r)
        self.rejected = Counter("syncd_rejected_versions", "Versions refused by verification", ["reason"],
                                registry=r)
        self.poll_errors = Counter("syncd_poll_errors", "Polls of the store that failed", registry=r)
        self.cache_corrupt = Counter("syncd_cache_corrupt", "Cached shards that no longer matched their hash "
                                     "(removed and fetched again)", registry=r)
        self.download_s = Histogram("syncd_download_seconds", "Downloading a version's missing shards",
                                    buckets=_SECONDS, registry=r)
        self.stage_s = Histogram("syncd_stage_seconds", "Staging a version on the engines (while serving)",
                                 buckets=_SECONDS, registry=r)
        self.pause_s = Histogram("syncd_pause_seconds", "A serving engine paused for one update (pause to resume)",
                                 buckets=_SECONDS, registry=r)
        self.apply_s = Histogram("syncd_apply_seconds", "A serving engine's apply call of one update",
                                 buckets=_SECONDS, registry=r)
        self.rebuild_s = Histogram("syncd_rebuild_seconds", "An engine rebuilt from a full version (paused "
                                   "throughout)", buckets=_SECONDS, registry=r)
        self.update_lag_s = Histogram("syncd_update_lag_seconds",
                                      "Manifest creation (trainer clock) to a serving engine serving the update",
                                      buckets=_SECONDS, registry=r)
        for kind in FAILURE_KINDS:
            self.failures.labels(kind)
        self.totals: _Tally = _Tally()
        self._lock = threading.Lock()
        self._server = None

    def count(self, name: str, n: float = 1, **labels) -> None:
        """Increment counter ``name`` (an attribute above) and its plain total ``name[:label]``."""
        metric = getattr(self, name)
        (metric.labels(**labels) if labels else metric).inc(n)
        if name in self._old:
            self._old[name].inc(n)
        with self._lock:
            self.totals[name + "".join(f":{v}" for v in labels.values())] += n

    def engine(self, name: str, version: int | None, lag: int | None) -> None:
        """Set engine ``name``'s version and lag gauges; an unknown one (None) has no series."""
        for gauge, v in ((self.engine_version, version), (self.engine_lag, lag)):
            if v is None:
                try:
                    gauge.remove(name)
                except KeyError:
                    pass
            else:
                gauge.labels(name).set(v)

    def failure(self, kind: str) -> None:
        self.count("failures", kind=kind)

    def render(self) -> bytes:
        """The exposition text (what ``/metrics`` serves)."""
        return generate_latest(self.registry)

    def serve(self, port: int, addr: str = "127.0.0.1") -> str:
        """Serve ``/metrics`` on ``addr:port`` (0: a free port) in a daemon thread; returns the URL."""
        self._server, _ = start_http_server(port, addr=addr, registry=self.registry)
        host, bound = self._server.server_address[:2]
        url = f"http://{host}:{bound}/metrics"
        log.info("metrics at %s", url)
        return url

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def _build() -> dict:
    import platform
    from importlib.metadata import PackageNotFoundError, version

    try:
        release = version("syncd")
    except PackageNotFoundError:  # a source tree on PYTHONPATH, not installed
        release = "unknown"
    return {"version": release, "python": platform.python_version()}
