"""The data plane: pipelined pulls of shards between peers, store reads into the cache, and the connections
they use. What a node holds, complete or in progress, and how chunks are verified is
:mod:`syncd.cluster.partials` (on the node's shard cache).

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

Everything here runs on one asyncio loop (not thread-safe).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time

import obstore
from obstore import exceptions as obx

from syncd.cluster import wire
from syncd.cluster.auth import TAG_LEN
from syncd.cluster.errors import ClusterError, NotHeld, ProtocolError, Stalled
from syncd.cluster.partials import PartialShards, ShardState, n_chunks
from syncd.cluster.wire import T
from syncd.errors import IntegrityError, ObjectNotFound, StoreError

log = logging.getLogger(__name__)


_HEX64 = frozenset("0123456789abcdef")


def is_sha_hex(s) -> bool:
    return isinstance(s, str) and len(s) == 64 and set(s) <= _HEX64


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


# ---------------------------------------------------------------------------------------------- serving


async def serve_pull(chan: wire.Channel, req: dict, cache: PartialShards, *, lookup, keepalive_s: float,
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


async def pull(chan: wire.Channel, st: ShardState, cache: PartialShards, *, stall_s: float, dead_s: float,
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


async def fetch_from_store(store, key: str, st: ShardState, cache: PartialShards, *, chunk_bytes: int,
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
