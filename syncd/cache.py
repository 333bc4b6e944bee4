"""The node's local disk cache of verified shards and manifests, shared by the daemon, the engines on the
node and the cluster layer.

Layout under ``root`` (one cache per node; any number of runs)::

    shards/<sha256 hex>                     a complete, verified shard: its bytes exactly as in the store
    manifests/<run_id>/<V:012d>.json        a manifest's exact bytes as stored (verified again when read)
    tmp/                                    files being written; removed on start, never read

Contract (shared with every writer, see ``/work/shared`` contract 2): a file under ``shards/`` is named by
the SHA-256 of its content and only ever appears by ``os.replace`` of a fully written, verified file in
``tmp/`` (same filesystem), or of a verified file its writer kept elsewhere under the same root
(:meth:`ShardCache.adopt`: the cluster's ``partial/`` files), so a reader never sees a partial shard, and a
crash leaves at most a stray file in ``tmp/``. Anyone may add shards that way (:meth:`ShardCache.put`);
eviction is this module's alone.

Bounded: :meth:`ShardCache.evict` removes least recently used shards until the cache fits ``max_bytes``,
but never a *pinned* shard: the caller (the daemon) pins what a restart needs -- the newest full version at
or below the engines' version plus the delta chain after it up to the newest version. If the pinned shards
alone exceed the bound, they are all kept and a warning is logged.

Thread- and process-safe for concurrent readers and writers (atomic renames; eviction tolerates files
vanishing under it). :func:`read_shards` reads a version's shards back, re-hashing each
(``syncd.engines.Update.from_cache`` builds an engine update on it).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import tempfile
import threading
import time
from pathlib import Path

from syncd import manifest as mf
from syncd.errors import IntegrityError

log = logging.getLogger(__name__)

ENV_CACHE_DIR = "SYNCD_CACHE_DIR"
DEFAULT_MAX_BYTES = 16 << 30
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def default_cache_dir() -> Path:
    """``$SYNCD_CACHE_DIR``, else ``$XDG_CACHE_HOME/syncd`` (``~/.cache/syncd``)."""
    if os.environ.get(ENV_CACHE_DIR):
        return Path(os.environ[ENV_CACHE_DIR]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base, "syncd")


def shard_path(cache_root: str | os.PathLike, sha256: str) -> Path:
    """Where the verified shard with this SHA-256 lives (it may not be there)."""
    if not _HEX64.match(sha256):
        raise ValueError(f"not a SHA-256 hex digest: {sha256!r:.80}")
    return Path(cache_root, "shards", sha256)


class ShardCache:
    """A bounded cache of verified shards (and manifests) under ``root``; see the module docstring.

    ``max_bytes``: the size :meth:`evict` trims the shards to (pinned shards excepted)."""

    def __init__(self, root: str | os.PathLike | None = None, *, max_bytes: int = DEFAULT_MAX_BYTES):
        if max_bytes < 0:
            raise ValueError("max_bytes must not be negative")
        self.root = Path(root) if root is not None else default_cache_dir()
        self.max_bytes = int(max_bytes)
        self.shards_dir = self.root / "shards"
        self.tmp_dir = self.root / "tmp"
        self.manifests_dir = self.root / "manifests"
        for d in (self.shards_dir, self.tmp_dir, self.manifests_dir):
            d.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"ShardCache({str(self.root)!r}, max_bytes={self.max_bytes})"

    def clean_tmp(self, stale_after_s: float = 86400.0) -> int:
        """Remove leftovers of interrupted writes from ``tmp/``; returns how many. Temp files are named
        ``<writer pid>.<...>``: a file whose writer is gone is removed (another live process's file is
        left alone), and so is anything older than ``stale_after_s`` (pids are reused)."""
        n, now = 0, time.time()
        for p in self.tmp_dir.iterdir():
            pid = p.name.split(".", 1)[0]
            try:
                alive = pid.isdigit() and pid_alive(int(pid))
                if not alive or now - p.stat().st_mtime >= stale_after_s:
                    p.unlink()
                    n += 1
            except FileNotFoundError:
                pass
        return n

    def _write_atomic(self, dest: Path, data, tag: str) -> None:
        """Write ``data`` to ``dest`` through a temp file and ``os.replace`` (readers never see a part)."""
        fd, tmp = self.temp_file(tag)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(tmp, dest)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise

    def temp_file(self, tag: str):
        """``(fd, path)`` of a new file in ``tmp/`` named after this process (see :meth:`clean_tmp`)."""
        return tempfile.mkstemp(dir=self.tmp_dir, prefix=f"{os.getpid()}.{tag}.")

    # ------------------------------------------------------------------------------------- shards

    def path(self, sha256: str) -> Path:
        return shard_path(self.root, sha256)

    def has(self, sha256: str, size: int | None = None) -> bool:
        """Whether a verified shard with this hash is here (and has ``size`` bytes, if given)."""
        try:
            st = self.path(sha256).stat()
        except FileNotFoundError:
            return False
        return size is None or st.st_size == size

    def check(self, sha256: str, size: int | None = None) -> str:
        """Re-hash the cached shard ``sha256`` (streamed): ``"ok"``, ``"missing"``, or ``"bad"`` (wrong size
        or hash; the file is removed so that it is fetched again)."""
        p = self.path(sha256)
        h = hashlib.sha256()
        try:
            with open(p, "rb") as fh:
                if size is not None and os.fstat(fh.fileno()).st_size != size:
                    ok = False
                else:
                    while chunk := fh.read(8 << 20):
                        h.update(chunk)
                    ok = h.hexdigest() == sha256
        except FileNotFoundError:
            return "missing"
        if not ok:
            self.discard(sha256)
            return "bad"
        return "ok"

    def put(self, sha256: str, data) -> Path:
        """Store ``data`` (bytes-like) as the shard ``sha256`` after checking its hash; atomic.

        Raises :class:`IntegrityError` (and writes nothing) if the bytes do not hash to ``sha256``."""
        got = hashlib.sha256(data).hexdigest()
        if got != sha256:
            raise IntegrityError(f"shard bytes hash to {got[:16]}..., not {sha256[:16]}...; not cached")
        return self.put_verified(sha256, data)

    def put_verified(self, sha256: str, data) -> Path:
        """Like :meth:`put` for bytes the caller has just hashed itself (skips the second hash)."""
        dest = self.path(sha256)
        if dest.exists():
            os.utime(dest)
            return dest
        self._write_atomic(dest, data, sha256[:16])
        return dest

    def adopt(self, sha256: str, path: str | os.PathLike) -> Path:
        """Move the complete file at ``path`` (same filesystem as the cache), which the caller has verified to
        hash to ``sha256``, into ``shards/`` atomically (``os.replace``). How the cluster's partial shards
        (:mod:`syncd.cluster.partials`) enter the cache."""
        dest = self.path(sha256)
        os.replace(path, dest)
        return dest

    def read(self, sha256: str, *, verify: bool = True) -> bytearray:
        """The shard's bytes. With ``verify`` the hash is checked again (a disk can rot): a mismatch
        removes the file and raises :class:`IntegrityError`. ``FileNotFoundError`` if it is not here."""
        p = self.path(sha256)
        with open(p, "rb") as fh:
            data = bytearray(os.fstat(fh.fileno()).st_size)
            fh.readinto(data)
        try:
            os.utime(p)  # recency for eviction
        except FileNotFoundError:
            pass
        if verify and hashlib.sha256(data).hexdigest() != sha256:
            self.discard(sha256)
            raise IntegrityError(f"cached shard {p} no longer matches its hash; removed it")
        return data

    def discard(self, sha256: str) -> None:
        try:
            self.path(sha256).unlink()
        except FileNotFoundError:
            pass

    def shard_bytes(self) -> int:
        """Total bytes of the cached shards."""
        total = 0
        for p in self.shards_dir.iterdir():
            try:
                total += p.stat().st_size
            except FileNotFoundError:
                pass
        return total

    def evict(self, pinned: set[str] = frozenset()) -> list[str]:
        """Remove least recently used shards not in ``pinned`` (hashes) until the shards fit
        ``max_bytes``; returns the hashes removed. Manifests of runs whose shards are gone stay (tiny)."""
        with self._lock:
            entries = []
            for p in self.shards_dir.iterdir():
                try:
                    st = p.stat()
                except FileNotFoundError:
                    continue
                entries.append((st.st_mtime, st.st_size, p.name))
            total = sum(e[1] for e in entries)
            removed = []
            for _, size, name in sorted(entries):
                if total <= self.max_bytes:
                    break
                if name in pinned:
                    continue
                self.discard(name)
                total -= size
                removed.append(name)
            if total > self.max_bytes:
                log.warning("cache %s holds %d bytes of shards a restart needs, over its %d-byte bound",
                            self.root, total, self.max_bytes)
            if removed:
                log.info("cache %s: evicted %d shards", self.root, len(removed))
            return removed

    # ------------------------------------------------------------------------------------- manifests

    def _manifest_path(self, run_id: str, version: int) -> Path:
        mf.version_dir(version)  # validates the number
        return self.manifests_dir / mf.check_run_id(run_id) / f"{version:012d}.json"

    def put_manifest(self, run_id: str, version: int, raw: bytes) -> None:
        """Keep a manifest's exact bytes (atomic). The caller has verified them; readers verify again."""
        dest = self._manifest_path(run_id, version)
        dest.parent.mkdir(parents=True, exist_ok=True)
        self._write_atomic(dest, raw, "manifest")

    def get_manifest(self, run_id: str, version: int) -> bytes | None:
        """The cached manifest bytes of ``version``, or None. Unverified: parse them with the key."""
        try:
            return self._manifest_path(run_id, version).read_bytes()
        except FileNotFoundError:
            return None

    def manifest_versions(self, run_id: str) -> list[int]:
        """Versions of ``run_id`` whose manifests are cached, ascending."""
        d = self.manifests_dir / mf.check_run_id(run_id)
        if not d.is_dir():
            return []
        out = []
        for p in d.iterdir():
            if p.suffix == ".json":
                v = mf.parse_version_dir(p.stem)
                if v is not None:
                    out.append(v)
        return sorted(out)

    def drop_manifest(self, run_id: str, version: int) -> None:
        try:
            self._manifest_path(run_id, version).unlink()
        except FileNotFoundError:
            pass


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this machine (one owned by another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_shard(cache_root: str | os.PathLike, s: mf.ShardEntry, version: int, *, verify: bool = True) -> bytearray:
    """The bytes of shard ``s`` (of ``version``) from the cache at ``cache_root``, its size and (``verify``)
    SHA-256 checked against the manifest. Raises ``FileNotFoundError`` if it is not cached and
    :class:`IntegrityError` if it does not match (the node cache must fetch it again)."""
    path = shard_path(cache_root, s.sha256)
    try:
        with open(path, "rb") as fh:
            data = bytearray(os.fstat(fh.fileno()).st_size)
            fh.readinto(data)
    except FileNotFoundError:
        raise FileNotFoundError(f"shard {s.key} of version {version} is not in the cache {path.parent.parent}") from None
    if len(data) != s.size or (verify and hashlib.sha256(data).hexdigest() != s.sha256):
        raise IntegrityError(f"cached shard {path} does not match the manifest of version {version} "
                             f"({'size' if len(data) != s.size else 'SHA-256'}); the node cache must fetch it again")
    return data


def read_shards(m: mf.Manifest, cache_root: str | os.PathLike, *, verify: bool = True, threads: int = 4) -> list:
    """Every shard of manifest ``m`` from the cache (:func:`read_shard`), ``threads`` at a time. Every shard is
    re-hashed as it is read (``verify``; bench/cache_verify.py measures the cost), so bytes that rotted or were
    altered in the cache since they were verified are refused."""
    from concurrent.futures import ThreadPoolExecutor

    def one(s):
        return read_shard(cache_root, s, m.version, verify=verify)

    if len(m.shards) <= 1 or threads <= 1:
        return [one(s) for s in m.shards]
    with ThreadPoolExecutor(min(threads, len(m.shards)), thread_name_prefix="syncd-cache-read") as pool:
        return list(pool.map(one, m.shards))


def update_from_cache(manifest, cache_root: str | os.PathLike, *, verify_shards: bool = True, threads: int = 4):
    """Moved to :meth:`syncd.engines.Update.from_cache <syncd.engines.update.Update.from_cache>`, kept for one
    release: the same update, its shards read at once (``Update.from_cache(...).load()``)."""
    from syncd.engines.update import Update

    return Update.from_cache(manifest, cache_root, verify_shards=verify_shards, threads=threads).load()
