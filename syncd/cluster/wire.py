"""The framing of the cluster protocol: every message between two daemons is one frame.

    frame   = header payload mac
    header  = type:u8 flags:u8 reserved:u16 length:u32        (network byte order, 8 bytes)
    payload = ``length`` bytes; its meaning depends on ``type``
    mac     = first 16 bytes of HMAC-SHA256(direction key, seq:u64 || header || covered)

``covered`` is the payload itself, except for ``DATA`` frames, whose payload is
``index:u32 have:u32 tag:16 chunk`` and whose ``covered`` is ``index have tag SHA-256(chunk)``: the receiver
hashes the chunk once, and that one hash both authenticates the frame and is checked against the chunk's
tag, which the shard's root made with the cluster secret (:mod:`syncd.cluster.transfer`). A relay
forwards the hash and tag it received, so sending costs no hashing at all.

``seq`` counts the frames of one direction of one connection from 0, so a frame cannot be replayed, dropped
or reordered without the MAC failing; each connection and direction has its own key
(:mod:`syncd.cluster.auth`). The handshake frames (``HELLO``, ``CHALLENGE``, ``AUTH``) come before any key
exists and carry no MAC; their sizes are fixed.

Bounds: the length of every frame type is checked against :data:`MAX_LEN` *before* its payload is read, and
JSON payloads are parsed strictly and bounded (:func:`parse_json`: an object, at most :data:`MAX_DEPTH`
levels, no floats, no duplicate members) -- a peer cannot make a daemon allocate more than the bound of the
frame type it sends, nor recurse deeper than the bound. The cluster parses what it reads from the store
(member records, the ``latest.json`` hint) and its own state file with the same function. A
:class:`Channel` is used by one task at a time for sending and one for receiving (asyncio; not thread-safe).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import struct
from dataclasses import dataclass
from enum import IntEnum

from syncd import jsonsafe
from syncd.cluster.errors import AuthError, ProtocolError

MAC_LEN = 16
HDR = struct.Struct("!BBHI")
DATA_PREFIX = struct.Struct("!II16s")
SEQ = struct.Struct("!Q")

#: the largest chunk the protocol carries (the configured chunk size must not exceed it)
MAX_CHUNK_BYTES = 16 << 20
#: the most chunks one shard may have (its chunk list is then 32 MiB)
MAX_CHUNKS = 1 << 20
#: the nesting bound of every JSON document the cluster reads (messages, store records); ours nest 3 deep
MAX_DEPTH = 16
#: the size bound of a JSON message (the largest frame, a PLAN)
MAX_JSON_BYTES = 96 << 20


class T(IntEnum):
    """Frame types."""

    HELLO = 1
    CHALLENGE = 2
    AUTH = 3
    READY = 4
    HEARTBEAT = 10
    PLAN = 11
    PULL = 20
    SHARD = 21
    DATA = 22
    WAIT = 23
    NOT_HELD = 24
    ERROR = 25


#: (min, max) payload bytes of each frame type
MAX_LEN = {
    T.HELLO: (53, 53),
    T.CHALLENGE: (68, 68),
    T.AUTH: (32, 32),
    T.READY: (0, 0),
    T.HEARTBEAT: (2, 1 << 20),
    T.PLAN: (2, MAX_JSON_BYTES),  # a manifest is at most 64 MiB; the plan's trees and roots are the rest
    T.PULL: (2, 4096),
    T.SHARD: (2, 4096),
    T.DATA: (DATA_PREFIX.size + 1, DATA_PREFIX.size + MAX_CHUNK_BYTES),
    T.WAIT: (2, 4096),
    T.NOT_HELD: (2, 4096),
    T.ERROR: (2, 4096),
}


@dataclass
class Frame:
    """One received frame. For ``DATA``: ``index``/``have``/``tag`` from the prefix, ``payload`` the chunk
    (a memoryview into the received bytes) and ``digest`` its SHA-256 (covered by the frame MAC)."""

    type: T
    payload: bytes | memoryview
    index: int = 0
    have: int = 0
    digest: bytes = b""
    tag: bytes = b""

    def json(self) -> dict:
        return parse_json(self.payload, self.type.name)


def parse_json(raw, what: str, *, max_bytes: int = MAX_JSON_BYTES) -> dict:
    """Strict, bounded JSON object (:func:`syncd.jsonsafe.loads`): at most ``max_bytes`` bytes and
    :data:`MAX_DEPTH` levels, ASCII, no floats or NaN, no duplicate members. Raises :class:`ProtocolError`."""
    obj = jsonsafe.loads(raw, what=what, max_bytes=max_bytes, max_depth=MAX_DEPTH, floats=False, ascii_only=True,
                         unique_members=True, error=ProtocolError)
    if not isinstance(obj, dict):
        raise ProtocolError(f"{what}: not a JSON object")
    return obj


def dump_json(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def check_header(raw: bytes) -> tuple[T, int]:
    """``(type, length)`` of a frame header, after checking the type is known and the length within its
    bounds; raises :class:`ProtocolError` before anything more is read."""
    typ, flags, reserved, length = HDR.unpack(raw)
    try:
        t = T(typ)
    except ValueError:
        raise ProtocolError(f"unknown frame type {typ}") from None
    lo, hi = MAX_LEN[t]
    if flags or reserved:
        raise ProtocolError(f"{t.name} frame with non-zero flags/reserved bits")
    if not lo <= length <= hi:
        raise ProtocolError(f"{t.name} frame of {length} bytes (allowed {lo}..{hi})")
    return t, length


async def read_plain(reader: asyncio.StreamReader, want: T) -> bytes:
    """A handshake frame (no MAC) of type ``want``; raises :class:`ProtocolError` for anything else."""
    hdr = await reader.readexactly(HDR.size)
    t, length = check_header(hdr)
    if t != want:
        raise ProtocolError(f"expected {want.name}, got {t.name}")
    return await reader.readexactly(length)


def write_plain(writer: asyncio.StreamWriter, t: T, payload: bytes) -> None:
    """Write a handshake frame (no MAC); ``ConnectionResetError`` if the connection closed under us."""
    try:
        writer.write(HDR.pack(t, 0, 0, len(payload)) + payload)
    except RuntimeError as exc:
        raise _closed(writer, exc, "the peer") from None


def _closed(writer: asyncio.StreamWriter, exc: RuntimeError, peer: str) -> BaseException:
    """uvloop raises RuntimeError for a write on a transport that closed under us (the peer went away): that is
    a ConnectionResetError; any other RuntimeError is returned as it is, to be raised."""
    if not writer.is_closing():
        return exc
    return ConnectionResetError(f"connection to {peer} is closed ({exc})")


class Channel:
    """An authenticated connection to one peer (made by :func:`syncd.cluster.auth.connect` or
    :func:`~syncd.cluster.auth.accept`). ``peer`` is the peer's rank; ``role`` is ``"control"`` or
    ``"data"``. ``send*`` must not be called concurrently with each other, nor ``recv`` with itself.

    ``recv`` raises :class:`ProtocolError` (malformed frame), :class:`AuthError` (MAC mismatch),
    ``asyncio.IncompleteReadError``/``ConnectionError`` (the peer went away); ``send*`` raise
    ``ConnectionError`` when the connection is gone."""

    def __init__(self, reader, writer, send_key: bytes, recv_key: bytes, peer: int, role: str):
        self.reader, self.writer = reader, writer
        self._send_key, self._recv_key = send_key, recv_key
        self._send_seq = 0
        self._recv_seq = 0
        self.peer, self.role = peer, role
        self.closed = False
        self.bytes_in = 0
        self.bytes_out = 0

    def _mac(self, key: bytes, seq: int, hdr: bytes, covered) -> bytes:
        m = hmac.new(key, SEQ.pack(seq), hashlib.sha256)
        m.update(hdr)
        m.update(covered)
        return m.digest()[:MAC_LEN]

    def _frame(self, t: T, payload, covered) -> tuple[bytes, bytes]:
        hdr = HDR.pack(t, 0, 0, len(payload))
        mac = self._mac(self._send_key, self._send_seq, hdr, covered)
        self._send_seq += 1
        return hdr, mac

    async def _write(self, *parts) -> None:
        try:
            for part in parts:
                self.writer.write(part)
            await self.writer.drain()
        except RuntimeError as exc:
            raise _closed(self.writer, exc, f"rank {self.peer}") from None

    async def send(self, t: T, payload: bytes = b"") -> None:
        hdr, mac = self._frame(t, payload, payload)
        self.bytes_out += len(payload) + HDR.size + MAC_LEN
        if len(payload) < 65536:
            await self._write(hdr + payload + mac)
        else:
            await self._write(hdr, payload, mac)

    async def send_json(self, t: T, obj) -> None:
        await self.send(t, dump_json(obj))

    async def send_data(self, index: int, have: int, chunk, digest: bytes, tag: bytes) -> None:
        """One chunk with its root tag; ``digest`` is its SHA-256, known already (not recomputed here)."""
        prefix = DATA_PREFIX.pack(index, have, tag)
        hdr = HDR.pack(T.DATA, 0, 0, len(prefix) + len(chunk))
        mac = self._mac(self._send_key, self._send_seq, hdr, prefix + digest)
        self._send_seq += 1
        self.bytes_out += len(chunk) + HDR.size + len(prefix) + MAC_LEN
        await self._write(hdr + prefix, chunk, mac)

    async def recv(self) -> Frame:
        hdr = await self.reader.readexactly(HDR.size)
        t, length = check_header(hdr)
        if t in (T.HELLO, T.CHALLENGE, T.AUTH):
            raise ProtocolError(f"{t.name} frame after the handshake")
        body = await self.reader.readexactly(length)
        mac = await self.reader.readexactly(MAC_LEN)
        self.bytes_in += length + HDR.size + MAC_LEN
        if t == T.DATA:
            prefix = body[:DATA_PREFIX.size]
            chunk = memoryview(body)[DATA_PREFIX.size:]
            digest = hashlib.sha256(chunk).digest()
            covered = prefix + digest
        else:
            covered, chunk, digest = body, body, b""
        want = self._mac(self._recv_key, self._recv_seq, hdr, covered)
        if not hmac.compare_digest(want, mac):
            raise AuthError(f"{t.name} frame #{self._recv_seq} from rank {self.peer}: MAC does not verify "
                            "(altered in transit, or not from the authenticated peer)")
        self._recv_seq += 1
        if t == T.DATA:
            index, have, tag = DATA_PREFIX.unpack(prefix)
            return Frame(t, chunk, index, have, digest, tag)
        return Frame(t, body)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self.writer.close()
            except Exception:  # noqa: BLE001 - closing a broken transport
                pass

    async def aclose(self) -> None:
        self.close()
        try:
            await asyncio.wait_for(self.writer.wait_closed(), 1.0)
        except Exception:  # noqa: BLE001
            pass
