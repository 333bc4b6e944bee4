"""The data plane: the local shard cache, chunk tags, pipelined pulls between peers, and store reads.

**Cache layout** (the contract with the node daemon): a complete, verified shard is the file
``<cache_root>/shards/<sha256 hex>``, created only by ``os.replace`` of a fully written file whose SHA-256
equals the manifest's (after ``fsync`` unless disabled). In-progress shards live in
``<cache_root>/partial/<sha256 hex>``, with ``<sha256 hex>.tags`` beside them (the chunk size, then each
received chunk's SHA-256 and tag): a receiver resumes there, at the first chunk it does not hold, even
after a restart.

**Chunks and their verification.** A shard is cut into chunks of ``chunk_bytes`` (the last one shorter).
The manifest only has the whole shard's SHA-256, so each chunk gets a *tag* from the shard's root (the node
that reads it from the store): ``HMAC(cluster secret, "syncd.cluster.chunk.v1" | shard sha256 | size |
chunk_bytes | index | SHA-256(chunk))``, 16 bytes. The tag travels with the chunk down the tree. Every node
hashes each chunk it receives once; that hash must match the chunk's tag (and the frame MAC) before the
chunk is written to the partial file or forwarded to a child. The whole file's SHA-256 is computed as the
chunks arrive in order and compared with the signed manifest's before the final ``os.replace``, so what
lands in ``shards/`` is exactly what the manifest names, even if the store or a member holding the
cluster secret sent wrong bytes.

Two root modes: **streaming** (default) -- the root tags and publishes each chunk as it arrives from the
store, so the store read and the broadcast overlap chunk by chunk; if the whole shard then fails the
manifest's SHA-256, the root discards it and tells its children to discard theirs (an ERROR frame with
``discard``), which they pass on down the tree: a corrupt store object costs a wasted broadcast, never a
bad cache file. **verify-first** (``verify_first=True``): the root checks the whole shard against the
manifest before it publishes any chunk -- no unverified byte ever leaves it, at the cost of one shard time
per version.

**Pipelining.** A node serves a chunk to its children as soon as it holds it: a pull streams from the
first chunk the child lacks, sending what the server has and waiting for the rest, so a tree of depth
``d`` adds about ``d`` chunk times, not ``d`` shard times. Each child has its own stream from the server's
file, so a slow child never holds back its siblings.

Everything here runs on one asyncio loop (not thread-safe); blocking file hashing runs in worker threads.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import struct
import time

import obstore
from obstore import exceptions as obx

from syncd.cluster import wire
from syncd.cluster.auth import TAG_LEN, ClusterSecret
from syncd.cluster.errors import ClusterError, NotHeld, ProtocolError, Stalled
from syncd.cluster.wire import T
from syncd.errors import IntegrityError, ObjectNotFound, StoreError

log = logging.getLogger(__name__)

_HEX64 = frozenset("0123456789abcdef")
_TAGS_HDR = struct.Struct("!8sI")
_TAGS_MAGIC = b"SYNCDTG1"
_REC = 32 + TAG_LEN


def n_chunks(size: int, chunk_bytes: int) -> int:
    return (size + chunk_bytes - 1) // chunk_bytes


def is_sha_hex(s) -> bool:
    return isinstance(s, str) and len(s) == 64 and set(s) <= _HEX64


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


class Throttle:
    """A token bucket (bytes per second) for the data a node sends; used by tests and benchmarks to make
    one node slow on loopback. ``None`` rate: no limit."""

    def __init__(self, rate: float | None):
        self.rate = rate
        self._t = time.monotonic()
        self._tokens = 0.0

    async def consume(self, n: int) -> None:
        if not self.rate:
            return
        now = time.monotonic()
        self._tokens = min(self.rate * 0.05, self._tokens + (now - self._t) * self.rate)
        self._t = now
        self._tokens -= n
        if self._tokens < 0:
            await asyncio.sleep(-self._tokens / self.rate)


class ShardState:
    """One shard in this node's cache: complete, in progress, or only expected.

    ``chunk_bytes`` is None until the shard's data starts arriving; then chunks ``[0, have)`` are verified,
    in the partial file, with their hashes and tags in memory (servable). ``epoch`` changes when the data
    is discarded. ``complete``: the final file is in ``shards/``. Waiters are woken on every change."""

    def __init__(self, cache: "ShardCache", sha256: str, size: int):
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


class ShardCache:
    """The local disk cache (see the module docstring for the layout). ``on_complete(state)``,
    ``on_change()`` and ``on_corrupt(state, why)`` are called (on the loop) when a shard completes /
    anything changes / a cached file was found not to match its hash and was removed.

    A file in ``shards/`` is trusted as complete by name and size until its chunk tags are first needed (to
    serve a peer): they are computed from the file together with its whole SHA-256, and a file that does not
    match (damaged on disk since it was verified, e.g. before a restart) is removed and fetched again, never
    served. A file of the wrong size is removed at once."""

    def __init__(self, root, secret: ClusterSecret, *, fsync: bool = True):
        self.root = os.fspath(root)
        self.shards_dir = os.path.join(self.root, "shards")
        self.partial_dir = os.path.join(self.root, "partial")
        os.makedirs(self.shards_dir, exist_ok=True)
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
        return os.path.join(self.shards_dir, sha)

    def partial_path(self, sha: str) -> str:
        return os.path.join(self.partial_dir, sha)

    def has(self, sha: str) -> bool:
        st = self.states.get(sha)
        return (st is not None and st.complete) or os.path.exists(self.final_path(sha))

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
        try:
            os.unlink(self.final_path(st.sha256))
        except FileNotFoundError:
            pass
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
        os.replace(self.partial_path(st.sha256), self.final_path(st.sha256))
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


# ---------------------------------------------------------------------------------------------- serving


async def serve_pull(chan: wire.Channel, req: dict, cache: ShardCache, *, lookup, keepalive_s: float,
                     chunk_bytes: int, throttle: Throttle | None = None, stats: dict | None = None) -> None:
    """Answer one PULL on ``chan``: a SHARD frame (the chunk size) once the data exists, then chunks from
    ``start`` as they become available.

    ``lookup(sha, size)`` returns the :class:`ShardState` (awaitable; None if this node neither holds nor
    expects the shard -> NOT_HELD). While the server has nothing new it sends WAIT every ``keepalive_s``
    seconds, so a child can tell a waiting parent from a dead one. If the data is discarded meanwhile, it
    sends ERROR with ``discard``. Raises :class:`ProtocolError` for a malformed request; connection errors
    propagate."""
    sha, size, start = req.get("sha"), req.get("size"), req.get("start")
    if (not is_sha_hex(sha) or not isinstance(size, int) or isinstance(size, bool) or not 0 < size < 1 << 44
            or not isinstance(start, int) or isinstance(start, bool) or not 0 <= start <= wire.MAX_CHUNKS):
        raise ProtocolError(f"malformed PULL {str(req)[:120]}")
    st = await lookup(sha, size)
    if st is None:
        await chan.send_json(T.NOT_HELD, {"sha": sha})
        return
    if st.size != size:
        await chan.send_json(T.ERROR, {"error": f"shard {sha[:16]} is {st.size} bytes, not {size}"})
        return
    while st.chunk_bytes is None:
        if st.complete:
            try:
                await cache.ensure_tags(st, chunk_bytes)
            except IntegrityError:
                await chan.send_json(T.NOT_HELD, {"sha": sha})
                return
            break
        if not await st.wait_change(keepalive_s):
            await chan.send_json(T.WAIT, {"have": 0})
    epoch, cb = st.epoch, st.chunk_bytes
    n = st.n
    await chan.send_json(T.SHARD, {"chunk_bytes": cb})
    i = start
    while i < n:
        if st.epoch != epoch:
            await chan.send_json(T.ERROR, {"error": "shard data failed verification upstream", "discard": True})
            return
        if i < st.have:
            data = st.read_chunk(i)
            if throttle is not None:
                await throttle.consume(len(data))
                if st.epoch != epoch:
                    continue
            await chan.send_data(i, st.have, data, st.digest(i), st.tag(i))
            if stats is not None:
                stats["served_bytes"] = stats.get("served_bytes", 0) + len(data)
                stats["served_chunks"] = stats.get("served_chunks", 0) + 1
            i += 1
        elif not await st.wait_change(keepalive_s):
            await chan.send_json(T.WAIT, {"have": st.have})


# ---------------------------------------------------------------------------------------------- receiving


async def pull(chan: wire.Channel, st: ShardState, cache: ShardCache, *, stall_s: float, dead_s: float,
               on_bytes=None) -> None:
    """Fill ``st`` from the peer on ``chan``, starting at the first chunk we lack; returns when the shard is
    complete and verified. ``on_bytes(n, backlogged)`` after each chunk (``backlogged``: the peer held it
    before it sent the previous one, so the gap measures the path, not the peer waiting). Raises
    :class:`NotHeld`, :class:`Stalled` (the data exists upstream but no chunk came for ``stall_s`` seconds;
    ``peer_starved`` says whether the peer itself was waiting), ``asyncio.TimeoutError`` (no frame at
    all for ``dead_s`` before the data started),
    :class:`ProtocolError`, :class:`~syncd.errors.IntegrityError`, :class:`ClusterError` (the peer's data
    was discarded: so was ours), or connection errors. What was received and verified stays (resumable)."""
    start = st.have
    await chan.send_json(T.PULL, {"sha": st.sha256, "size": st.size, "start": start})
    last_data = last_frame = time.monotonic()
    started = False
    upstream = 0  # chunks the peer said it had (DATA and WAIT frames carry it)
    while not st.complete:
        now = time.monotonic()
        timeout = last_frame + dead_s - now
        if started:
            timeout = min(timeout, last_data + stall_s - now)
        try:
            f = await asyncio.wait_for(chan.recv(), max(0.01, timeout))
        except asyncio.TimeoutError:
            now = time.monotonic()
            if now - last_frame >= dead_s:
                raise asyncio.TimeoutError(f"rank {chan.peer} sent no frame for {dead_s:.1f}s") from None
            raise Stalled(f"rank {chan.peer} sent no chunk of {st.sha256[:12]} for {stall_s:.1f}s",
                          peer_starved=upstream <= st.have) from None
        last_frame = time.monotonic()
        if f.type == T.DATA:
            if not started:
                raise ProtocolError("DATA before SHARD")
            if f.index != st.have:
                raise ProtocolError(f"chunk {f.index} arrived, expected {st.have}")
            cache.write_chunk(st, f.index, f.payload, f.digest, f.tag)
            last_data = time.monotonic()
            if on_bytes is not None:
                on_bytes(len(f.payload), upstream > f.index)  # was the peer already holding this chunk?
            upstream = max(upstream, f.have)
            if st.have == st.n:
                await cache.finalize(st)
        elif f.type == T.SHARD:
            cb = f.json().get("chunk_bytes")
            if started or not isinstance(cb, int) or isinstance(cb, bool) or not 4096 <= cb <= wire.MAX_CHUNK_BYTES:
                raise ProtocolError(f"bad SHARD frame (chunk_bytes {cb!r:.20})")
            if n_chunks(st.size, cb) > wire.MAX_CHUNKS:
                raise ProtocolError(f"shard of {st.size} bytes in chunks of {cb}: too many chunks")
            cache.start(st, cb)
            if st.have != start:
                raise Stalled(f"resume point moved to chunk {st.have} (chunk size {cb}); pulling again")
            started, last_data = True, time.monotonic()
        elif f.type == T.WAIT:
            have = f.json().get("have")
            if isinstance(have, int) and not isinstance(have, bool):
                upstream = max(upstream, have)
            if started and time.monotonic() - last_data > stall_s:
                raise Stalled(f"rank {chan.peer} sent no chunk of {st.sha256[:12]} for {stall_s:.1f}s",
                              peer_starved=upstream <= st.have)
        elif f.type == T.NOT_HELD:
            raise NotHeld(f"rank {chan.peer} does not hold shard {st.sha256[:12]}")
        elif f.type == T.ERROR:
            msg = f.json()
            if msg.get("discard") is True:
                cache.discard(st)
            raise ClusterError(f"rank {chan.peer}: {str(msg.get('error'))[:200]}")
        else:
            raise ProtocolError(f"unexpected {f.type.name} during a pull")


async def fetch_from_store(store, key: str, st: ShardState, cache: ShardCache, *, chunk_bytes: int,
                           verify_first: bool = False, on_bytes=None) -> None:
    """Read shard ``st`` from the object store (one streaming ranged GET) into the cache.

    Streaming (default): from the first chunk it lacks, each chunk is hashed, tagged and published as it
    arrives; at the end the whole SHA-256 is checked against the manifest (on a mismatch the data is
    discarded, down the tree too, and :class:`IntegrityError` raised). ``verify_first``: the whole shard is
    read and checked before any chunk is published. ``on_bytes(n)`` counts the bytes read from the store.
    Raises :class:`IntegrityError` (wrong size or content), :class:`ObjectNotFound`, :class:`StoreError`."""
    if st.complete:
        return
    if verify_first and st.have:
        cache.discard(st)
    cb = st.chunk_bytes or chunk_bytes
    if st.fd is None or st.tags_fd is None:
        cache.open_partial(st, cb, keep=st.have)
        if verify_first:
            st.chunk_bytes = None  # not servable before it is verified
    elif not verify_first:
        cache.start(st, cb)
    n = n_chunks(st.size, cb)
    first = 0 if verify_first else st.have
    epoch = st.epoch
    running = hashlib.sha256() if verify_first else None
    hashes, tags = bytearray(), bytearray()
    i = first
    if first < n:
        try:
            resp = await obstore.get_async(store.raw, key, options={"range": (first * cb, st.size)})
            buf = bytearray()
            async for part in resp.stream(min_chunk_size=cb):
                if on_bytes is not None:
                    on_bytes(len(part))
                buf += part
                pos = 0
                while i < n and len(buf) - pos >= min(cb, st.size - i * cb):
                    length = min(cb, st.size - i * cb)
                    chunk = memoryview(buf)[pos:pos + length]
                    h = hashlib.sha256(chunk).digest()
                    tag = cache.secret.chunk_tag(st.sha, st.size, cb, i, h)
                    if verify_first:
                        os.pwrite(st.fd, chunk, i * cb)
                        running.update(chunk)
                        hashes += h
                        tags += tag
                    else:
                        if st.epoch != epoch:
                            raise ClusterError(f"shard {st.sha256[:12]} was discarded while it was read")
                        cache.write_chunk(st, i, chunk, h, tag)
                    del chunk
                    pos += length
                    i += 1
                del buf[:pos]
                if len(buf) and i >= n:
                    raise IntegrityError(f"{key} is longer than the manifest's {st.size} bytes")
        except (FileNotFoundError, obx.NotFoundError):
            raise ObjectNotFound(f"{store.url}: {key} does not exist") from None
        except obx.BaseError as exc:
            raise StoreError(f"{store.url}: read of {key}: {str(exc).splitlines()[0] if str(exc) else exc}") from exc
    if i != n:
        raise IntegrityError(f"{key}: the object ended at chunk {i} of {n} (shorter than the manifest's size)")
    if verify_first:
        got = running.hexdigest()
        if got != st.sha256:
            cache.discard(st)
            raise IntegrityError(f"{key}: SHA-256 {got[:16]}... does not match the manifest ({st.sha256[:16]}...)")
        cache.open_partial(st, cb, keep=0)
        os.write(st.tags_fd, b"".join(hashes[32 * k:32 * k + 32] + tags[TAG_LEN * k:TAG_LEN * k + TAG_LEN]
                                      for k in range(n)))
        st.chunk_bytes, st.hashes, st.tags, st.running, st.have = cb, hashes, tags, running, n
        st.notify()
    await cache.finalize(st)


# ---------------------------------------------------------------------------------------------- connections


class PeerPool:
    """Authenticated data connections to peers, reused across pulls. ``dial(rank)`` makes a new one."""

    def __init__(self, dial, *, max_idle: int = 4):
        self._dial = dial
        self._idle: dict[int, list[wire.Channel]] = {}
        self.max_idle = max_idle

    async def acquire(self, rank: int) -> wire.Channel:
        idle = self._idle.get(rank)
        while idle:
            ch = idle.pop()
            if not ch.closed and not ch.reader.at_eof():
                return ch
        return await self._dial(rank)

    def release(self, ch: wire.Channel) -> None:
        idle = self._idle.setdefault(ch.peer, [])
        if ch.closed or len(idle) >= self.max_idle:
            ch.close()
        else:
            idle.append(ch)

    def drop(self, rank: int) -> None:
        for ch in self._idle.pop(rank, []):
            ch.close()

    def close(self) -> None:
        for rank in list(self._idle):
            self.drop(rank)
