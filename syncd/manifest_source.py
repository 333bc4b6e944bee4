"""Verified manifests of one run, from memory, the node cache, then the store: what the node daemon and the
cluster controller read manifests through.

Every manifest is parsed, authenticated and validated (:func:`syncd.manifest.parse` with the signing key)
each time it comes from disk or the store (:func:`syncd.versions.read_manifest_bytes`, the one bounded read),
including from the node cache. A version whose manifest is refused (bad signature, malformed, replayed, not
chaining to its base) or whose shards do not match it is remembered as *rejected* with the reason, reported
once (the log, metrics, the ``on_reject`` hook) and left alone for ``retry_failed_s``; planners route around
it. Thread-safe (one lock around the maps; I/O outside it).
"""

from __future__ import annotations

import logging
import threading
import time

from syncd import manifest as mf
from syncd.errors import ManifestMismatch, SignatureError, VersionNotFound
from syncd.signing import NO_KEY_HELP
from syncd.versions import check_link, read_manifest_bytes

log = logging.getLogger(__name__)


def reason_of(exc: BaseException) -> str:
    """Metric label of a verification failure."""
    from syncd.errors import IntegrityError, ManifestError

    if isinstance(exc, SignatureError):
        return "signature"
    if isinstance(exc, ManifestMismatch):
        return "mismatch"
    if isinstance(exc, ManifestError):
        return "manifest"
    if isinstance(exc, IntegrityError):
        return "integrity"
    if isinstance(exc, VersionNotFound):
        return "gone"
    return "other"


class ManifestSource:
    """``get(version) -> Manifest`` (verified) and ``raw(version) -> bytes`` for ``run_id``.

    ``store``: a :class:`~syncd.store.Store` (None: cache only, e.g. with the cluster layer delivering);
    ``cache``: a :class:`~syncd.cache.ShardCache`; ``key``: the resolved signing key (None: unsigned
    manifests accepted, as configured); ``metrics``: a :class:`~syncd.daemon.metrics.DaemonMetrics`;
    ``on_reject(version, reason, exc)``: called once per fresh rejection (e.g. the cluster's event log)."""

    def __init__(self, run_id: str, *, store, cache, key, metrics=None, retry_failed_s: float = 60.0,
                 allow_unsigned: bool = False, on_reject=None):
        self.run_id, self.store, self.cache, self.key = mf.check_run_id(run_id), store, cache, key
        self.metrics, self.retry_failed_s, self.allow_unsigned = metrics, retry_failed_s, allow_unsigned
        self.on_reject = on_reject
        self.signed_seen: str | None = None  # without a key: why the first signed manifest met was refused
        self._lock = threading.Lock()
        self._mem: dict[int, tuple[mf.Manifest, bytes]] = {}
        self._rejected: dict[int, tuple[str, float]] = {}

    # ------------------------------------------------------------------------------------- rejection

    def rejected(self, version: int) -> str | None:
        """Why ``version`` was refused, while that is recent (``retry_failed_s``), else None."""
        with self._lock:
            got = self._rejected.get(version)
            if got is None:
                return None
            if time.monotonic() - got[1] > self.retry_failed_s:
                del self._rejected[version]
                return None
            return got[0]

    def reject(self, version: int, exc: BaseException) -> None:
        """Remember that ``version`` is unusable (``exc`` says why); counted once per rejection."""
        reason = reason_of(exc)
        with self._lock:
            fresh = version not in self._rejected
            self._rejected[version] = (f"{reason}: {exc}", time.monotonic())
            self._mem.pop(version, None)
        self.cache.drop_manifest(self.run_id, version)
        if fresh:
            log.error("run %s version %d rejected (%s): %s", self.run_id, version, reason, exc)
            if self.metrics is not None:
                self.metrics.count("rejected", reason=reason)
                self.metrics.failure({"mismatch": "manifest", "other": "manifest", "gone": "store"}.get(reason, reason))
            if self.on_reject is not None:
                self.on_reject(version, reason, exc)

    def rejections(self) -> dict[int, str]:
        """``{version: why}`` of the versions rejected recently (within ``retry_failed_s``)."""
        now = time.monotonic()
        with self._lock:
            return {v: why for v, (why, at) in self._rejected.items() if now - at <= self.retry_failed_s}

    def forget_rejections(self) -> None:
        """Read every rejected version again when next asked (e.g. a new controller term)."""
        with self._lock:
            self._rejected.clear()

    # ------------------------------------------------------------------------------------- reads

    def add(self, raw: bytes) -> mf.Manifest:
        """Verify manifest bytes delivered from elsewhere (the cluster layer) and keep them."""
        m = self._parse(raw, None, f"run {self.run_id} manifest delivered")
        self._keep(m, bytes(raw))
        return m

    def remember(self, m: mf.Manifest, raw: bytes) -> None:
        """Keep a manifest this process has verified already (``m`` parsed from ``raw`` with the same key)."""
        self._keep(m, bytes(raw))

    def _keep(self, m: mf.Manifest, raw: bytes) -> None:
        with self._lock:
            self._mem[m.version] = (m, raw)
        if self.cache.get_manifest(self.run_id, m.version) != raw:
            self.cache.put_manifest(self.run_id, m.version, raw)

    def get(self, version: int) -> mf.Manifest:
        """The verified manifest of ``version``. Raises :class:`VersionNotFound` if it has none (nowhere),
        a :class:`~syncd.errors.ManifestError` (and records the rejection) if it is refused, and
        :class:`~syncd.errors.StoreError` if the store cannot be read."""
        return self._get(version)[0]

    def raw(self, version: int) -> bytes:
        """The exact bytes of ``version``'s verified manifest (see :meth:`get`)."""
        return self._get(version)[1]

    def entry(self, version: int) -> tuple[mf.Manifest, bytes]:
        """``(get(version), raw(version))`` in one read."""
        return self._get(version)

    def _get(self, version: int) -> tuple[mf.Manifest, bytes]:
        with self._lock:
            hit = self._mem.get(version)
        if hit is not None:
            return hit
        why = self.rejected(version)
        if why is not None:
            raise ManifestMismatch(f"run {self.run_id} version {version} was rejected: {why}")
        where = f"run {self.run_id} version {version}"
        raw = self.cache.get_manifest(self.run_id, version)
        if raw is not None:
            try:
                m = self._parse(raw, version, where + " (cache)")
                self._keep(m, raw)
                return m, raw
            except mf.ManifestError as exc:  # a cached copy that no longer verifies (key changed, rot)
                log.warning("dropping cached manifest of %s: %s", where, exc)
                self.cache.drop_manifest(self.run_id, version)
        if self.store is None:
            raise VersionNotFound(f"{where} is not in the node cache (and no store is configured)")
        try:
            raw = read_manifest_bytes(self.store, self.run_id, version)
        except VersionNotFound:
            raise VersionNotFound(f"{where} has no manifest in {self.store.url}") from None
        except mf.ManifestError as exc:  # too large: refused unread
            exc = mf.ManifestError(f"{where}: {exc}")
            self.reject(version, exc)
            raise exc from None
        try:
            m = self._parse(raw, version, f"{self.store.url} {where}")
        except mf.ManifestError as exc:
            self.reject(version, exc)
            raise
        self._keep(m, raw)
        return m, raw

    def _parse(self, raw: bytes, version: int | None, where: str) -> mf.Manifest:
        """Verify as configured. Without a key, once a signed manifest has been met (and refused: no
        ``allow_unsigned``), unsigned ones are refused too: a store that signs does not publish unsigned
        versions, so those are forgeries a key-less reader could otherwise be fed."""
        try:
            m = mf.parse(raw, key=self.key, run_id=self.run_id, version=version, where=where,
                         allow_unsigned=self.allow_unsigned)
        except SignatureError as exc:
            if self.key is None and self.signed_seen is None:
                self.signed_seen = str(exc)
            raise
        if self.key is None and not self.allow_unsigned and self.signed_seen is not None:
            raise SignatureError(f"{where}: manifest is unsigned, but this run's store holds signed manifests "
                                 f"and no signing key is configured: {NO_KEY_HELP}")
        return m

    def check_link(self, base: mf.Manifest, child: mf.Manifest) -> None:
        """Raise (and reject ``child``) unless delta ``child`` was made against exactly ``base``."""
        try:
            check_link(base, child)
        except ManifestMismatch as exc:
            self.reject(child.version, exc)
            raise

    def forget_below(self, version: int) -> None:
        """Drop in-memory manifests older than ``version`` (the cached files stay)."""
        with self._lock:
            for v in [v for v in self._mem if v < version]:
                del self._mem[v]
