"""Peer authentication with the cluster secret: mutual challenge/response, per-connection keys, and the
tag that authenticates a shard's chunk list end to end.

Handshake (client = the daemon that dials; ``K`` = the cluster secret; frames of :mod:`syncd.cluster.wire`)::

    C -> S  HELLO      magic "SYNCDCL1" | role:u8 | rank:u32 | key id:8 | nonce_c:32
    S -> C  CHALLENGE  rank:u32 | nonce_s:32 | proof_s:32     proof_s = HMAC(K, "server" | transcript)
    C -> S  AUTH       proof_c:32                             proof_c = HMAC(K, "client" | transcript)
    S -> C  READY      (empty, the first frame with a MAC)

``transcript`` is the HELLO payload followed by the server's rank and nonce; the two proofs use different
labels, so neither side can be used as an oracle for the other's. Each side checks the other's proof in
constant time; a client that fails is dropped by the server before anything else is read, and counted as
refused. Both sides then derive ``session = HMAC(K, "session" | transcript)`` and one key per direction,
so every frame after the handshake carries a MAC (:class:`~syncd.cluster.wire.Channel`): nobody without
the secret can join, read a plan, or inject a byte into an established connection. The whole handshake is
bounded by a timeout; its frames have fixed sizes.

The secret comes from ``SYNCD_CLUSTER_SECRET`` (``hex:``, ``base64:`` or text, as signing keys) or the file
named by ``SYNCD_CLUSTER_SECRET_FILE``; at least 16 bytes. It is never logged. Thread-safe (immutable).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import secrets
import struct

from syncd.cluster import wire
from syncd.cluster.errors import AuthError, ProtocolError
from syncd.cluster.wire import T
from syncd.signing import parse_key

ENV_SECRET = "SYNCD_CLUSTER_SECRET"
ENV_SECRET_FILE = "SYNCD_CLUSTER_SECRET_FILE"
MAGIC = b"SYNCDCL1"
ROLES = {"control": 1, "data": 2}
_ROLE_NAMES = {v: k for k, v in ROLES.items()}
NO_RANK = 0xFFFFFFFF
_HELLO = struct.Struct("!8sBI8s32s")
_CHALLENGE = struct.Struct("!I32s32s")
CHUNK_DOMAIN = b"syncd.cluster.chunk.v1"
TAG_LEN = 16


class ClusterSecret:
    """The shared secret of one cluster (at least 16 bytes). ``key_id`` is a public fingerprint that
    appears in HELLO so that a peer with another secret gets a clear error; the secret never leaves."""

    __slots__ = ("_secret", "key_id")

    def __init__(self, secret: bytes):
        if not isinstance(secret, (bytes, bytearray)) or len(secret) < 16:
            raise ValueError("the cluster secret must be at least 16 bytes")
        self._secret = bytes(secret)
        self.key_id = hashlib.sha256(b"syncd-cluster-key-id\0" + self._secret).digest()[:8]

    def __repr__(self) -> str:
        return f"ClusterSecret(key_id={self.key_id.hex()})"

    def mac(self, label: bytes, *parts: bytes) -> bytes:
        """HMAC-SHA256 over ``label || 0 || parts...`` (32 bytes)."""
        m = hmac.new(self._secret, label + b"\0", hashlib.sha256)
        for p in parts:
            m.update(p)
        return m.digest()

    def chunk_tag(self, sha256: bytes, size: int, chunk_bytes: int, index: int, digest: bytes) -> bytes:
        """The end-to-end tag (16 bytes) a shard's root puts on chunk ``index`` whose SHA-256 is ``digest``:
        HMAC over the shard's hash and size, the chunk size, the index and the digest
        (see :mod:`syncd.cluster.transfer`)."""
        return self.mac(CHUNK_DOMAIN, sha256, struct.pack("!QII", size, chunk_bytes, index), digest)[:TAG_LEN]

    @classmethod
    def parse(cls, text: str | bytes) -> "ClusterSecret":
        """From ``hex:...``, ``base64:...`` or plain text/bytes; ``ValueError`` if too short or malformed."""
        try:
            return cls(parse_key(text).secret)
        except ValueError as exc:
            raise ValueError(str(exc).replace("signing key", "cluster secret")) from None

    @classmethod
    def from_env(cls, environ=None) -> "ClusterSecret | None":
        """The secret of ``SYNCD_CLUSTER_SECRET`` or ``SYNCD_CLUSTER_SECRET_FILE``, or None if neither is
        set. ``ValueError`` if one is set but unusable."""
        env = os.environ if environ is None else environ
        if env.get(ENV_SECRET):
            return cls.parse(env[ENV_SECRET])
        if env.get(ENV_SECRET_FILE):
            return cls.from_file(env[ENV_SECRET_FILE])
        return None

    @classmethod
    def from_file(cls, path) -> "ClusterSecret":
        try:
            with open(path, "rb") as fh:
                raw = fh.read(1 << 16)
        except OSError as exc:
            raise ValueError(f"cluster secret file {str(path)!r} cannot be read: {exc}") from None
        return cls.parse(raw.rstrip(b"\r\n").decode("utf-8"))


def _keys(secret: ClusterSecret, transcript: bytes) -> tuple[bytes, bytes]:
    session = secret.mac(b"syncd.cluster.session.v1", transcript)
    return (hmac.new(session, b"c2s", hashlib.sha256).digest(),
            hmac.new(session, b"s2c", hashlib.sha256).digest())


async def connect(host: str, port: int, secret: ClusterSecret, *, rank: int, role: str,
                  timeout: float = 5.0, limit: int = 1 << 20) -> wire.Channel:
    """Dial a peer and authenticate both ways; returns a :class:`~syncd.cluster.wire.Channel`.

    Raises :class:`AuthError` if the peer does not prove knowledge of the secret (or refuses us),
    :class:`ProtocolError` for a malformed reply, ``OSError``/``asyncio.TimeoutError`` if it cannot be
    reached within ``timeout`` seconds."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, limit=limit), timeout)
    try:
        return await asyncio.wait_for(_client(reader, writer, secret, rank, role), timeout)
    except BaseException:
        writer.close()
        raise


async def _client(reader, writer, secret, rank, role) -> wire.Channel:
    nonce_c = secrets.token_bytes(32)
    hello = _HELLO.pack(MAGIC, ROLES[role], rank, secret.key_id, nonce_c)
    wire.write_plain(writer, T.HELLO, hello)
    await writer.drain()
    try:
        ch = await wire.read_plain(reader, T.CHALLENGE)
    except asyncio.IncompleteReadError:
        raise AuthError("the peer closed the connection during the handshake (it refused us: another "
                        "cluster secret?)") from None
    peer_rank, nonce_s, proof_s = _CHALLENGE.unpack(ch)
    transcript = hello + struct.pack("!I", peer_rank) + nonce_s
    if not hmac.compare_digest(proof_s, secret.mac(b"syncd.cluster.server.v1", transcript)):
        raise AuthError(f"peer (rank {peer_rank}) failed to prove the cluster secret")
    wire.write_plain(writer, T.AUTH, secret.mac(b"syncd.cluster.client.v1", transcript))
    await writer.drain()
    c2s, s2c = _keys(secret, transcript)
    chan = wire.Channel(reader, writer, c2s, s2c, peer_rank, role)
    try:
        f = await chan.recv()
    except asyncio.IncompleteReadError:
        raise AuthError(f"peer (rank {peer_rank}) refused our proof of the cluster secret") from None
    if f.type != T.READY:
        raise ProtocolError(f"expected READY, got {f.type.name}")
    return chan


async def accept(reader, writer, secret: ClusterSecret, *, rank: int, timeout: float = 5.0) -> wire.Channel:
    """Server side of the handshake on an accepted connection. Returns the channel; raises
    :class:`AuthError` / :class:`ProtocolError` / ``asyncio.TimeoutError`` / ``IncompleteReadError`` for a
    peer that is not a member (the caller counts it as refused and closes the connection)."""
    return await asyncio.wait_for(_server(reader, writer, secret, rank), timeout)


async def _server(reader, writer, secret, rank) -> wire.Channel:
    hello = await wire.read_plain(reader, T.HELLO)
    magic, role, peer_rank, key_id, _nonce_c = _HELLO.unpack(hello)
    if magic != MAGIC:
        raise ProtocolError("not a syncd cluster connection (bad magic)")
    if role not in _ROLE_NAMES:
        raise ProtocolError(f"unknown connection role {role}")
    if key_id != secret.key_id:
        raise AuthError(f"peer claiming rank {peer_rank} uses another cluster secret "
                        f"(key id {key_id.hex()}, ours {secret.key_id.hex()})")
    nonce_s = secrets.token_bytes(32)
    transcript = hello + struct.pack("!I", rank) + nonce_s
    wire.write_plain(writer, T.CHALLENGE, _CHALLENGE.pack(rank, nonce_s,
                                                          secret.mac(b"syncd.cluster.server.v1", transcript)))
    await writer.drain()
    proof_c = await wire.read_plain(reader, T.AUTH)
    if not hmac.compare_digest(proof_c, secret.mac(b"syncd.cluster.client.v1", transcript)):
        raise AuthError(f"peer claiming rank {peer_rank} failed to prove the cluster secret")
    c2s, s2c = _keys(secret, transcript)
    chan = wire.Channel(reader, writer, s2c, c2s, peer_rank, _ROLE_NAMES[role])
    await chan.send(T.READY)
    return chan
