"""``Update``: one version to stage or load, in the trainer's tensor names -- held in memory, or a reference to a
version whose shards are in the node cache, which every engine can take.

An engine in this process reads :attr:`Update.tensors`; for a cache reference they are read from the node
cache on first use (every shard re-hashed as it is read, ``syncd.cache.read_shards``) and kept, so the
engines of one process that stage the same ``Update`` share one read. An engine in another process is sent
:attr:`Update.source` (the manifest's exact bytes and the cache root) by its client
(:class:`syncd.engines.client.RemoteAdapter`) and reads the shards itself.

Thread-safe: the first reader of ``tensors`` loads them under a lock; the others wait and share the result.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Mapping

from syncd import manifest as mf

__all__ = ["Update", "CachedVersion"]


@dataclass(frozen=True)
class CachedVersion:
    """Where a version's shards are: ``manifest`` (parsed; its signature checked by whoever put the shards in
    the cache -- the daemon), ``raw`` (its exact bytes, what crosses the wire; None when only the parsed form
    is at hand) and ``cache_root`` (the node cache, :mod:`syncd.cache`). ``verify_shards``/``threads``: how the
    shards are read (see :func:`syncd.cache.read_shards`)."""

    manifest: mf.Manifest
    raw: bytes | None
    cache_root: str
    verify_shards: bool = True
    threads: int = 4


class Update:
    """An update to stage, in the trainer's names.

    ``kind="delta"``: ``tensors`` maps trainer tensor names to codec blobs (``bytes``/``memoryview`` of
    format 1 or 2, ``docs/delta-format.md``) taking ``base_version`` to ``version``; tensors not named are
    unchanged. ``kind="full"``: ``tensors`` maps every trainer name to its full CPU tensor (``base_version``
    is ignored). ``checksums`` (trainer name -> ``syncd.ops.checksum`` of the full result tensor) lets the
    engine or controller verify. The engine may keep references to the buffers until ``apply`` returns.

    ``source``: the version in the node cache this update stands for (:meth:`from_cache`); ``tensors`` is
    then read from there on first use. Reading raises ``FileNotFoundError`` for a shard missing from the
    cache and :class:`~syncd.errors.IntegrityError` for one that does not match the manifest.
    """

    def __init__(self, version: int, kind: str, tensors: Mapping[str, object] | None = None,
                 base_version: int | None = None, checksums: Mapping[str, int] | None = None, *,
                 source: CachedVersion | None = None):
        if tensors is None and source is None:
            raise ValueError("an Update needs its tensors or a source to read them from")
        self.version, self.kind, self.base_version = version, kind, base_version
        self.checksums = dict(checksums or {})
        self.source = source
        self._tensors = tensors
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        where = f", source={self.source.cache_root!r}" if self.source is not None else ""
        return f"Update(version={self.version}, kind={self.kind!r}, base_version={self.base_version}{where})"

    @property
    def tensors(self) -> Mapping[str, object]:
        """The blobs (delta) or tensors (full) by trainer name; read from :attr:`source` on first use."""
        if self._tensors is None:
            with self._lock:
                if self._tensors is None:
                    self._tensors = self._read()
        return self._tensors

    def load(self) -> "Update":
        """Read :attr:`tensors` now (raising here, not in the engine, what reading raises); returns self."""
        self.tensors  # noqa: B018 -- read for its effect
        return self

    def _read(self) -> Mapping[str, object]:
        from syncd.cache import read_shards

        s = self.source
        return tensors_of(s.manifest, read_shards(s.manifest, s.cache_root, verify=s.verify_shards, threads=s.threads))

    # ------------------------------------------------------------------------------------- makers

    @classmethod
    def from_cache(cls, manifest, cache_root: str | os.PathLike, *, raw: bytes | None = None,
                   verify_shards: bool = True, threads: int = 4) -> "Update":
        """The update of a version whose shards are in the node cache at ``cache_root``.

        ``manifest`` is a parsed, verified :class:`~syncd.manifest.Manifest` (``raw``: its exact bytes, needed
        to send the update to an engine in another process), or a manifest's exact bytes whose signature the
        caller has checked (the daemon that put the shards in the cache did); their structure is checked here
        (:class:`~syncd.errors.ManifestError`). Nothing is read until :attr:`tensors` is."""
        if isinstance(manifest, mf.Manifest):
            m = manifest
        else:
            raw = bytes(manifest)
            m = mf.parse(raw, key=None, allow_unsigned=True, where="manifest of a cached update")
        return cls(m.version, m.kind, None, m.base_version, {t.name: t.checksum for t in m.tensors},
                   source=CachedVersion(m, raw, os.fspath(cache_root), verify_shards, threads))

    @classmethod
    def from_shards(cls, m: mf.Manifest, shards) -> "Update":
        """The update of verified manifest ``m`` from its verified shards (``syncd.versions.fetch_shards``):
        delta blobs as memoryviews into the shards, or full tensors (checked against the manifest's checksums
        by ``syncd.versions.load_full``)."""
        return cls(m.version, m.kind, tensors_of(m, shards), m.base_version, {t.name: t.checksum for t in m.tensors})


def tensors_of(m: mf.Manifest, shards) -> dict:
    """``Update.tensors`` of manifest ``m`` from its shards (see :meth:`Update.from_shards`)."""
    if m.kind == "delta":
        return {t.name: memoryview(shards[t.shard])[t.offset:t.offset + t.length] for t in m.tensors}
    from syncd.versions import load_full

    return load_full(m, list(shards))
