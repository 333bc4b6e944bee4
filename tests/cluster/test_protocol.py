"""The wire protocol on real loopback sockets: mutual authentication, frame MACs, hostile frames, chunk
tags, pipelined pulls that resume at the first missing chunk (also after a restart), and store reads."""

from __future__ import annotations

import asyncio
import hashlib
import os

import pytest

from syncd.cluster import auth, transfer, wire
from syncd.cluster.auth import ClusterSecret
from syncd.cluster.errors import AuthError, NotHeld, ProtocolError
from syncd.cluster.partials import PartialShards
from syncd.cluster.wire import T
from syncd.errors import IntegrityError
from syncd.store import Store

SECRET = ClusterSecret(b"protocol-test-secret-0123456789")
OTHER = ClusterSecret(b"some-other-cluster-secret-xyz")


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


class Server:
    """A minimal node: authenticates, serves pulls from ``cache``; counts refused connections."""

    def __init__(self, cache, secret=SECRET, rank=0, rate=None):
        self.cache, self.secret, self.rank = cache, secret, rank
        self.throttle = transfer.Throttle(rate)
        self.refused, self.requests, self.errors = 0, [], []

    async def __aenter__(self):
        self.srv = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        self.port = self.srv.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc):
        self.srv.close()

    async def lookup(self, sha, size):
        return self.cache.get(sha)

    async def handle(self, reader, writer):
        try:
            chan = await auth.accept(reader, writer, self.secret, rank=self.rank, timeout=2)
        except (AuthError, ProtocolError, asyncio.TimeoutError, asyncio.IncompleteReadError) as exc:
            self.refused += 1
            self.errors.append(exc)
            writer.close()
            return
        try:
            while True:
                f = await chan.recv()
                self.requests.append(f.json())
                await transfer.serve_pull(chan, f.json(), self.cache, lookup=self.lookup, keepalive_s=0.2,
                                          chunk_bytes=4096, throttle=self.throttle)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except (AuthError, ProtocolError) as exc:
            self.errors.append(exc)
        finally:
            chan.close()


def put_shard(cache, data: bytes) -> str:
    sha = hashlib.sha256(data).hexdigest()
    with open(cache.final_path(sha), "wb") as fh:
        fh.write(data)
    return sha


def test_mutual_authentication_and_refusals():
    async def main():
        async with Server(None) as s:
            ch = await auth.connect("127.0.0.1", s.port, SECRET, rank=3, role="data")
            assert ch.peer == 0 and ch.role == "data"
            ch.close()
            with pytest.raises(AuthError):  # we do not know the secret: the server refuses us
                await auth.connect("127.0.0.1", s.port, OTHER, rank=3, role="data")
            r, w = await asyncio.open_connection("127.0.0.1", s.port)  # not the protocol at all
            w.write(b"\x01\x00\x00\x00\xff\xff\xff\xff" + b"x" * 64)
            await w.drain()
            assert await r.read() == b""
            w.close()
            await asyncio.sleep(0.1)
            assert s.refused == 2
            assert any(isinstance(e, ProtocolError) for e in s.errors)
        async with Server(None, secret=OTHER) as s:  # a server without our secret cannot fool us either
            with pytest.raises(AuthError):
                await auth.connect("127.0.0.1", s.port, SECRET, rank=3, role="data")

    run(main())


def test_frame_bounds_are_checked_before_reading():
    with pytest.raises(ProtocolError, match="DATA frame of"):
        wire.check_header(wire.HDR.pack(T.DATA, 0, 0, wire.MAX_CHUNK_BYTES + 100))
    with pytest.raises(ProtocolError, match="unknown frame type"):
        wire.check_header(wire.HDR.pack(99, 0, 0, 10))
    with pytest.raises(ProtocolError, match="PULL frame of"):
        wire.check_header(wire.HDR.pack(T.PULL, 0, 0, 1 << 20))
    with pytest.raises(ProtocolError):
        wire.parse_json(b'{"a": 1.5}', "x")
    with pytest.raises(ProtocolError):
        wire.parse_json(b'{"a": 1, "a": 2}', "x")


def test_altered_replayed_and_injected_frames_are_refused(tmp_path):
    async def main():
        got = asyncio.Queue()

        async def handle(reader, writer):
            chan = await auth.accept(reader, writer, SECRET, rank=0)
            try:
                while True:
                    await got.put(await chan.recv())
            except Exception as exc:  # noqa: BLE001
                await got.put(exc)

        srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        ch = await auth.connect("127.0.0.1", port, SECRET, rank=1, role="control")
        await ch.send_json(T.HEARTBEAT, {"rank": 1})
        assert (await got.get()).json() == {"rank": 1}
        # forge the next frame by hand: right framing, but a MAC made without the session key
        body = wire.dump_json({"rank": 666})
        ch.writer.write(wire.HDR.pack(T.HEARTBEAT, 0, 0, len(body)) + body + b"\0" * wire.MAC_LEN)
        await ch.writer.drain()
        err = await got.get()
        assert isinstance(err, AuthError)
        ch.close()
        # a replay: the same valid bytes sent again on a new connection fail (per-connection keys, seq)
        ch2 = await auth.connect("127.0.0.1", port, SECRET, rank=1, role="control")
        hdr, mac = ch2._frame(T.HEARTBEAT, body, body)
        raw = hdr + body + mac
        ch2.writer.write(raw + raw)
        await ch2.writer.drain()
        assert (await got.get()).json() == {"rank": 666}
        assert isinstance(await got.get(), AuthError), "the second copy (wrong seq) is refused"
        ch2.close()
        srv.close()

    run(main())


def test_pull_is_verified_resumes_after_restart_and_serves_while_receiving(tmp_path):
    data = os.urandom(50_000)

    async def main():
        src = PartialShards(tmp_path / "src", SECRET, fsync=False)
        sha = put_shard(src, data)
        src.get(sha)
        dst = PartialShards(tmp_path / "dst", SECRET, fsync=False)
        async with Server(src, rate=100_000) as s:  # slow enough to stop it mid-shard
            st = dst.state(sha, len(data))
            ch = await auth.connect("127.0.0.1", s.port, SECRET, rank=1, role="data")
            got_chunks = []
            task = asyncio.create_task(transfer.pull(ch, st, dst, stall_s=2, dead_s=2,
                                                     on_bytes=lambda n, b: got_chunks.append(n)))
            while st.have < 5:
                await asyncio.sleep(0.001)
            task.cancel()  # a "crash" mid-shard
            ch.close()
            have = st.have
            assert 5 <= have < st.n and not os.path.exists(dst.final_path(sha))
        # a new process: a fresh cache object finds the partial file and its tags, and resumes there
        dst2 = PartialShards(tmp_path / "dst", SECRET, fsync=False)
        st2 = dst2.state(sha, len(data))
        await dst2.recover(st2)
        assert st2.have == have
        async with Server(src) as s:
            ch = await auth.connect("127.0.0.1", s.port, SECRET, rank=1, role="data")
            await transfer.pull(ch, st2, dst2, stall_s=2, dead_s=2)
            assert s.requests[-1]["start"] == have, "resumed at the first chunk it lacked"
            ch.close()
        assert st2.complete and open(dst2.final_path(sha), "rb").read() == data
        assert not os.path.exists(dst2.partial_path(sha))

    run(main())


def test_bad_chunk_tag_or_content_is_refused_before_write(tmp_path):
    async def main():
        cache = PartialShards(tmp_path, SECRET, fsync=False)
        data = os.urandom(10_000)
        sha = hashlib.sha256(data).hexdigest()
        st = cache.state(sha, len(data))
        cache.start(st, 4096)
        chunk = data[:4096]
        h = hashlib.sha256(chunk).digest()
        forged = OTHER.chunk_tag(st.sha, st.size, 4096, 0, h)  # a tag made with another secret
        with pytest.raises(IntegrityError):
            cache.write_chunk(st, 0, chunk, h, forged)
        good = SECRET.chunk_tag(st.sha, st.size, 4096, 0, h)
        with pytest.raises(IntegrityError):  # right tag, other bytes
            cache.write_chunk(st, 0, chunk, hashlib.sha256(b"x" * 4096).digest(), good)
        with pytest.raises(ProtocolError):
            cache.write_chunk(st, 1, chunk, h, good)  # out of order
        assert st.have == 0 and os.path.getsize(cache.partial_path(sha)) == 0
        # a member with the secret tags wrong bytes consistently: the chunks pass, the whole file does not
        evil = os.urandom(len(data))
        for i in range(3):
            c = evil[i * 4096:(i + 1) * 4096]
            hc = hashlib.sha256(c).digest()
            cache.write_chunk(st, i, c, hc, SECRET.chunk_tag(st.sha, st.size, 4096, i, hc))
        with pytest.raises(IntegrityError):
            await cache.finalize(st)
        assert not os.path.exists(cache.final_path(sha)) and st.have == 0, "discarded, nothing in shards/"

    run(main())


@pytest.mark.parametrize("verify_first", [False, True])
def test_store_read_checks_the_manifest_hash(tmp_path, verify_first):
    async def main():
        store = Store(tmp_path / "store")
        data = os.urandom(70_000)
        store.put("obj", data)
        cache = PartialShards(tmp_path / "c", SECRET, fsync=False)
        st = cache.state(hashlib.sha256(data).hexdigest(), len(data))
        read = []
        await transfer.fetch_from_store(store, "obj", st, cache, chunk_bytes=8192, verify_first=verify_first,
                                        on_bytes=read.append)
        assert st.complete and sum(read) == len(data)
        assert open(cache.final_path(st.sha256), "rb").read() == data
        store.put("bad", data[:-1] + bytes([data[-1] ^ 1]))  # same size, one bit flipped
        st2 = cache.state(hashlib.sha256(data + b"!").hexdigest(), len(data))
        with pytest.raises(IntegrityError):
            await transfer.fetch_from_store(store, "bad", st2, cache, chunk_bytes=8192, verify_first=verify_first)
        assert not st2.complete and st2.have == 0 and not os.path.exists(cache.final_path(st2.sha256))

    run(main())


def test_a_damaged_cached_shard_is_removed_never_served(tmp_path):
    async def main():
        data = os.urandom(30_000)
        src = PartialShards(tmp_path / "src", SECRET, fsync=False)
        sha = put_shard(src, data)
        with open(src.final_path(sha), "r+b") as fh:  # one bit flipped on disk, same size (after a restart)
            fh.seek(12345)
            fh.write(bytes([data[12345] ^ 1]))
        corrupt = []
        src.on_corrupt = lambda st, why: corrupt.append(why)
        dst = PartialShards(tmp_path / "dst", SECRET, fsync=False)
        async with Server(src) as s:
            ch = await auth.connect("127.0.0.1", s.port, SECRET, rank=1, role="data")
            with pytest.raises(NotHeld):
                await transfer.pull(ch, dst.state(sha, len(data)), dst, stall_s=2, dead_s=2)
            ch.close()
        assert corrupt and "hashes to" in corrupt[0] and not src.has(sha) and not os.path.exists(src.final_path(sha))
        assert dst.states[sha].have == 0, "no byte of it was taken"
        # a cached file of the wrong size is removed as soon as the shard is looked at
        short = hashlib.sha256(data + b"x").hexdigest()
        with open(src.final_path(short), "wb") as fh:
            fh.write(data)
        st = src.state(short, len(data) + 1)
        assert not st.complete and not os.path.exists(src.final_path(short)) and "bytes, not" in corrupt[-1]

    run(main())


def test_a_write_on_a_connection_closed_under_us_is_a_connection_error():
    """uvloop raises RuntimeError for a write on a closed transport (a killed relay, mid-handshake): the wire
    turns it into ConnectionResetError, which callers take as "the peer went away" and switch source."""
    import uvloop

    async def main():
        srv = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        reader, writer = await asyncio.open_connection("127.0.0.1", srv.sockets[0].getsockname()[1])
        writer.close()
        await asyncio.sleep(0.1)  # the transport is closed now, not only closing
        with pytest.raises(ConnectionResetError, match="connection to the peer is closed"):
            wire.write_plain(writer, T.HELLO, b"hello")
        chan = wire.Channel(reader, writer, b"k" * 32, b"k" * 32, peer=3, role="data")
        with pytest.raises(ConnectionResetError, match="connection to rank 3 is closed"):
            await chan.send(T.HEARTBEAT)
        srv.close()

    uvloop.run(main())
