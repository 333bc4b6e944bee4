"""The cluster's partial-shard bookkeeping, on top of the node's shard cache (:class:`syncd.cache.ShardCache`):
shards being received chunk by chunk, their chunk tags, and resuming them after a restart.

**Layout** (the node cache's contract, ``syncd/cache.py``): a complete, verified shard is the node cache's file
``<cache_root>/shards/<sha256 hex>``; a shard completed here enters it only by
:meth:`ShardCache.adopt <syncd.cache.ShardCache.adopt>` (``os.replace`` of a fully written file whose SHA-256
equals the manifest's, after ``fsync`` unless disabled). In-progress shards live in
``<cache_root>/partial/<sha256 hex>``, with ``<sha256 hex>.tags`` beside them (the chunk size, then each
received chunk's SHA-256 and tag): a receiver resumes there, at the first chunk it does not hold, even after a
restart.

**Chunks and their verification.** A shard is cut into chunks of ``chunk_bytes`` (the last one shorter).
The manifest only has the whole shard's SHA-256, so each chunk gets a *tag* from the shard's root (the node
that reads it from the store): ``HMAC(cluster secret, "syncd.cluster.chunk.v1" | shard sha256 | size |
chunk_bytes | index | SHA-256(chunk))``, 16 bytes. The tag travels with the chunk down the tree. Every node
hashes each chunk it receives once; that hash must match the chunk's tag (and the frame MAC) before the
chunk is written to the partial file or forwarded to a child. The whole file's SHA-256 is computed as the
chunks arrive in order and compared with the signed manifest's before the file enters the cache, so what
lands in ``shards/`` is exactly what the manifest names, even if the store or a member holding the cluster
secret sent wrong bytes. (How chunks move: :mod:`syncd.cluster.transfer`.)

Everything here runs on one asyncio loop (not thread-safe); blocking file hashing runs in worker threads.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import struct

from syncd.cache import ShardCache
from syncd.cluster import wire
from syncd.cluster.auth import TAG_LEN, ClusterSecret
from syncd.cluster.errors import ProtocolError
from syncd.errors import IntegrityError

log = logging.getLogger(__name__)

__all__ = ["PartialShards", "ShardState", "n_chunks"]

_TAGS_HDR = struct.Struct("!8sI")
_TAGS_MAGIC = b"SYNCDTG1"
_REC = 32 + TAG_LEN


def n_chunks(size: int, chunk_bytes: int) -> int:
    return (size + chunk_bytes - 1) // chunk_bytes


def _recover_partial(path: str, tags_path: str, sha: bytes, size: int, secret: ClusterSecret):
    """Blocking: the verified prefix of a partial file from an earlier run, as
    ``(chunk_bytes, hashes, tags, running_sha256, count)``, or None if there is nothing usable."""
    try:
        with open(tags_path, "rb") as fh:
            head = fh.read(_TAGS_HDR.size)
            if len(head) != _TAGS_HDR.size:
                return None
            magic, cb = _TAGS_HDR.unpack(head)
            if magic != _TAGS_MAGIC or not 4096 <= cb <= wire.MAX_CHUNK_BYTES:
                return None
            recs = fh.read(_REC * n_chunks(size, cb))
        data_fh = open(path, "rb")
    except OSError:
        return None
    hashes, tags, running, count = bytearray(), bytearray(), hashlib.sha256(), 0
    with data_fh:
        for i in range(len(recs) // _REC):
            h, tag = recs[_REC * i:_REC * i + 32], recs[_REC * i + 32:_REC * (i + 1)]
            want = min(cb, size - i * cb)
            data = data_fh.read(want)
            if (len(data) != want or hashlib.sha256(data).digest() != h
                    or not hmac.compare_digest(tag, secret.chunk_tag(sha, size, cb, i, h))):
                break
            running.update(data)
            hashes += h
            tags += tag
            count += 1
    return cb, hashes, tags, running, count


def _hash_file(path: str, size: int, cb: int, sha: bytes, secret: ClusterSecret):
    """Blocking: ``(hashes, tags, whole-file SHA-256)`` of every chunk of a complete cached file."""
    hashes, tags, whole = bytearray(), bytearray(), hashlib.sha256()
    with open(path, "rb") as fh:
        for i in range(n_chunks(size, cb)):
            data = fh.read(min(cb, size - i * cb))
            h = hashlib.sha256(data).digest()
            whole.update(data)
            hashes += h
            tags += secret.chunk_tag(sha, size, cb, i, h)
    return hashes, tags, whole.digest()


class ShardState:
    """One shard in this node's cache: complete, in progress, or only expected.

    ``chunk_bytes`` is None until the shard's data starts arriving; then chunks ``[0, have)`` are verified,
    in the partial file, with their hashes and tags in memory (servable). ``epoch`` changes when the data
    is discarded. ``complete``: the final file is in ``shards/``. Waiters are woken on every change."""

    def __init__(self, cache: "PartialShards", sha256: str, size: int):
        self.cache, self.sha256, self.size = cache, sha256, size
        self.sha = bytes.fromhex(sha256)
        self.chunk_bytes: int | None = None
        self.hashes = bytearray()
        self.tags = bytearray()
        self.have = 0
        self.epoch = 0
        self.complete = False
        self.recovered = False
        self.fd: int | None = None
        self.tags_fd: int | None = None
        self.running = hashlib.sha256()
        self._change = asyncio.get_running_loop().create_future()
        self.source: str | None = None
        self.busy = False

    @property
    def n(self) -> int:
        return n_chunks(self.size, self.chunk_bytes)

    def chunk_len(self, i: int) -> int:
        return min(self.chunk_bytes, self.size - i * self.chunk_bytes)

    def notify(self) -> None:
        if not self._change.done():
            self._change.set_result(None)
        self._change = asyncio.get_running_loop().create_future()
        self.cache.pulse()

    async def wait_change(self, timeout: float) -> bool:
        """Wait until the state changes; False on timeout."""
        try:
            await asyncio.wait_for(asyncio.shield(self._change), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def read_chunk(self, i: int) -> bytes:
        return os.pread(self.fd, self.chunk_len(i), i * self.chunk_bytes)

    def tag(self, i: int) -> bytes:
        return bytes(self.tags[TAG_LEN * i:TAG_LEN * (i + 1)])

    def digest(self, i: int) -> bytes:
        return bytes(self.hashes[32 * i:32 * (i + 1)])


class PartialShards:
    """The shards this node holds, complete or in progress (see the module docstring), over ``cache`` (the node's
    :class:`~syncd.cache.ShardCache`, or its root directory). ``on_complete(state)``, ``on_change()`` and
    ``on_corrupt(state, why)`` are called (on the loop) when a shard completes / anything changes / a cached file
    was found not to match its hash and was removed.

    A file in the node cache is trusted as complete by name and size until its chunk tags are first needed (to
    serve a peer): they are computed from the file together with its whole SHA-256, and a file that does not
    match (damaged on disk since it was verified, e.g. before a restart) is removed and fetched again, never
    served. A file of the wrong size is removed at once."""

    def __init__(self, cache, secret: ClusterSecret, *, fsync: bool = True):
        self.cache = cache if isinstance(cache, ShardCache) else ShardCache(cache)
        self.root = os.fspath(self.cache.root)
        self.partial_dir = os.path.join(self.root, "partial")
        os.makedirs(self.partial_dir, exist_ok=True)
        self.secret, self.fsync = secret, fsync
        self.states: dict[str, ShardState] = {}
        self.on_complete = None
        self.on_change = None
        self.on_corrupt = None

    def pulse(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def final_path(self, sha: str) -> str:
        return os.fspath(self.cache.path(sha))

    def partial_path(self, sha: str) -> str:
        return os.path.join(self.partial_dir, sha)

    def has(self, sha: str) -> bool:
        st = self.states.get(sha)
        return (st is not None and st.complete) or self.cache.has(sha)

    def get(self, sha: str) -> ShardState | None:
        st = self.states.get(sha)
        if st is None and os.path.exists(self.final_path(sha)):
            st = self.state(sha, os.path.getsize(self.final_path(sha)))
        return st

    def state(self, sha: str, size: int) -> ShardState:
        """The state of shard ``sha`` (made on first use: complete if the file is in ``shards/``). Raises
        :class:`IntegrityError` if ``size`` differs from what is known."""
        st = self.states.get(sha)
        if st is not None:
            if st.size != size:
                raise IntegrityError(f"shard {sha[:16]}... is {st.size} bytes here, {size} asked")
            return st
        st = ShardState(self, sha, size)
        final = self.final_path(sha)
        self.states[sha] = st
        if os.path.exists(final):
            if os.path.getsize(final) != size:
                self._corrupt(st, f"cached shard {final} is {os.path.getsize(final)} bytes, not {size}")
            else:
                st.fd = os.open(final, os.O_RDONLY)
                st.complete = True
        return st

    def _corrupt(self, st: ShardState, why: str) -> None:
        """Remove a damaged file from ``shards/``: the shard is no longer held (it is fetched again)."""
        log.error("%s; removed, it is fetched again", why)
        if st.fd is not None:
            os.close(st.fd)
        st.fd, st.complete, st.chunk_bytes, st.have = None, False, None, 0
        st.hashes, st.tags, st.running = bytearray(), bytearray(), hashlib.sha256()
        st.epoch += 1
        self.cache.discard(st.sha256)
        st.notify()
        if self.on_corrupt is not None:
            self.on_corrupt(st, why)

    async def recover(self, st: ShardState) -> None:
        """Adopt the verified prefix of a partial file left by an earlier run (once per shard)."""
        if st.recovered or st.complete:
            return
        st.recovered = True
        path = self.partial_path(st.sha256)
        got = await asyncio.to_thread(_recover_partial, path, path + ".tags", st.sha, st.size, self.secret)
        if got is None or not got[4] or st.chunk_bytes is not None:
            return
        cb, hashes, tags, running, count = got
        self.open_partial(st, cb, keep=count)
        st.hashes, st.tags, st.running, st.have = hashes, tags, running, count
        log.info("shard %s: resuming at chunk %d/%d from %s", st.sha256[:12], count, st.n, path)
        st.notify()
        if st.have == st.n:
            await self.finalize(st)

    def open_partial(self, st: ShardState, cb: int, *, keep: int = 0) -> None:
        """Open the partial file and its tags file for chunks of ``cb`` bytes, keeping ``keep`` records."""
        path = self.partial_path(st.sha256)
        if st.fd is None:
            st.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        if st.tags_fd is None:
            st.tags_fd = os.open(path + ".tags", os.O_RDWR | os.O_CREAT, 0o644)
        os.ftruncate(st.tags_fd, _TAGS_HDR.size + _REC * keep)
        os.pwrite(st.tags_fd, _TAGS_HDR.pack(_TAGS_MAGIC, cb), 0)
        os.lseek(st.tags_fd, 0, os.SEEK_END)
        st.chunk_bytes = cb

    def start(self, st: ShardState, cb: int) -> None:
        """Begin receiving ``st`` in chunks of ``cb`` (keeps what it has if ``cb`` is the same)."""
        if st.complete:
            return
        if st.chunk_bytes == cb:
            return
        if st.chunk_bytes is not None:
            self.discard(st)
        self.open_partial(st, cb)
        st.notify()

    def write_chunk(self, st: ShardState, i: int, data, digest: bytes, tag: bytes) -> None:
        """Write chunk ``i`` (must be the next one) whose SHA-256 is ``digest`` and publish it to servers.
        Raises :class:`IntegrityError` if the tag does not verify, :class:`ProtocolError` if out of order."""
        if i != st.have or i >= st.n:
            raise ProtocolError(f"shard {st.sha256[:16]}...: chunk {i} out of order (expected {st.have})")
        if len(data) != st.chunk_len(i):
            raise ProtocolError(f"shard {st.sha256[:16]}... chunk {i}: {len(data)} bytes, expected {st.chunk_len(i)}")
        if not hmac.compare_digest(tag, self.secret.chunk_tag(st.sha, st.size, st.chunk_bytes, i, digest)):
            raise IntegrityError(f"shard {st.sha256[:16]}... chunk {i}: content does not match its root's tag")
        os.pwrite(st.fd, data, i * st.chunk_bytes)
        os.write(st.tags_fd, digest + tag)
        st.running.update(data)
        st.hashes += digest
        st.tags += tag
        st.have += 1
        st.notify()

    async def finalize(self, st: ShardState) -> None:
        """Check the whole SHA-256 against the manifest's and move the file into ``shards/`` atomically.
        On a mismatch the data is discarded and :class:`IntegrityError` raised."""
        if st.complete:
            return
        got = st.running.hexdigest()
        if got != st.sha256:
            self.discard(st)
            raise IntegrityError(f"shard {st.sha256[:16]}...: the assembled file hashes to {got[:16]}..., not "
                                 "the manifest's; discarded")
        if self.fsync:
            await asyncio.to_thread(os.fsync, st.fd)
        if st.complete:
            return
        self.cache.adopt(st.sha256, self.partial_path(st.sha256))
        try:
            os.close(st.tags_fd)
            os.unlink(self.partial_path(st.sha256) + ".tags")
        except OSError:
            pass
        st.tags_fd = None
        st.complete = True
        st.notify()
        if self.on_complete is not None:
            self.on_complete(st)

    def discard(self, st: ShardState) -> None:
        """Forget an incomplete shard's data (after an integrity failure here or upstream)."""
        if st.complete:
            return
        if st.fd is not None:
            os.ftruncate(st.fd, 0)
        if st.tags_fd is not None:
            os.ftruncate(st.tags_fd, 0)
        st.have, st.running, st.chunk_bytes = 0, hashlib.sha256(), None
        st.hashes, st.tags = bytearray(), bytearray()
        st.epoch += 1
        st.notify()

    async def ensure_tags(self, st: ShardState, cb: int) -> None:
        """Chunk hashes and tags of a complete cached shard (computed from the file once, in a thread, with
        its whole SHA-256). Raises :class:`IntegrityError` if the file does not match (it was removed)."""
        if st.chunk_bytes is None:
            hashes, tags, whole = await asyncio.to_thread(_hash_file, self.final_path(st.sha256), st.size, cb,
                                                          st.sha, self.secret)
            if whole != st.sha:
                self._corrupt(st, f"cached shard {self.final_path(st.sha256)} hashes to {whole.hex()[:16]}..., "
                                  "not its name")
                raise IntegrityError(f"cached shard {st.sha256[:16]}... is damaged; removed")
            if st.chunk_bytes is None and st.complete:
                st.chunk_bytes, st.hashes, st.tags = cb, hashes, tags
                st.have = st.n
                st.notify()
