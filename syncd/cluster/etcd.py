"""A client of etcd's v3 API through its JSON gateway: leases (:meth:`EtcdClient.grant`, :meth:`~EtcdClient.keepalive`,
:meth:`~EtcdClient.revoke`), keys (:meth:`~EtcdClient.put`, :meth:`~EtcdClient.range_prefix`) and the election
service ``v3election`` (:meth:`~EtcdClient.campaign`, :meth:`~EtcdClient.leader`, :meth:`~EtcdClient.observe`,
:meth:`~EtcdClient.resign`). The cluster's etcd election (:mod:`syncd.cluster.etcd_election`) is built on it; one
HTTP exchange is :mod:`syncd.cluster.etcd_gateway`.

**Why the JSON gateway.** Every etcd since 3.3 (Debian's 3.4 ``etcd-server``, the etcd Dynamo uses) serves it on
its client port: each v3 call is an HTTP/1.1 ``POST`` of a JSON body (keys and values base64, 64-bit integers as
decimal strings). Speaking it takes the standard library only -- asyncio streams, the transport the cluster's own
wire protocol runs on -- so the node's event loop never blocks, and a call is abandoned by closing its connection
(etcd then cancels it: a pending campaign withdraws its candidate key). The maintained Python clients speak gRPC
(grpcio and generated stubs, a large native dependency) and the pure-Python ones are unmaintained; a synchronous
``http.client`` call in a worker thread could not be cancelled while a campaign waits.

**Connections.** One short connection per call: nothing goes stale when etcd restarts. ``endpoint`` may list
several URLs, comma-separated (an etcd cluster's members): a call tries them in turn, starting at the last one
that answered. No TLS client certificates or etcd user authentication (``https://`` verifies the server only).

**Hostile input.** Replies are read bounded and parsed strictly (:mod:`syncd.cluster.etcd_gateway`), then checked
field by field here (base64 that decodes, integers in range, the members each call needs, keys inside the range
asked for); anything else raises :class:`~syncd.cluster.errors.EtcdProtocolError`.

**Errors** (:mod:`syncd.cluster.errors`), each naming the endpoint and the call: ``EtcdUnavailable`` (no
connection, no answer within the timeout, a connection closed mid-reply, etcd without quorum: try again later),
``LeaseNotFound`` (the lease expired or was revoked), ``EtcdProtocolError``, and ``EtcdError`` for any other
error etcd answered with.

Thread-safety: an :class:`EtcdClient` may be used by any number of tasks of one asyncio loop at once.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from dataclasses import dataclass

from syncd.cluster.errors import EtcdError, EtcdProtocolError, EtcdUnavailable, LeaseNotFound
from syncd.cluster.etcd_gateway import Exchange, parse_endpoints

__all__ = ["EtcdClient", "KeyValue", "LeaderKey", "Lease"]

#: etcd's answer to ``/v3/election/leader`` when nobody leads (an error reply)
NO_LEADER = "election: no leader"

_INT64 = 1 << 63


@dataclass(frozen=True)
class Lease:
    """A granted lease: its ``id`` and its ``ttl`` in whole seconds (etcd may raise a short TTL to its minimum)."""

    id: int
    ttl: int


@dataclass(frozen=True)
class KeyValue:
    """A key as etcd stores it; revisions are etcd's (each write raises the store's revision by one)."""

    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


@dataclass(frozen=True)
class LeaderKey:
    """What :meth:`EtcdClient.campaign` returns to the caller that now leads election ``name``: its key, the key's
    creation revision ``rev`` (a later leader's is always higher: the election's fencing token) and its lease."""

    name: bytes
    key: bytes
    rev: int
    lease: int


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


class _Reply:
    """Field checks of one decoded reply object; errors name the endpoint and the call."""

    def __init__(self, obj, where: str):
        if not isinstance(obj, dict):
            raise EtcdProtocolError(f"{where}: not a JSON object")
        self.obj, self.where = obj, where

    def sub(self, name: str, *, required: bool = True) -> "_Reply | None":
        v = self.obj.get(name)
        if v is None and not required:
            return None
        if not isinstance(v, dict):
            raise EtcdProtocolError(f"{self.where}: member {name!r} is missing or not an object")
        return _Reply(v, f"{self.where}.{name}")

    def int(self, name: str, *, lo: int = 0, hi: int = _INT64 - 1) -> int:
        """A 64-bit integer member (a decimal string or a number; absent means 0, as proto3 leaves zeros out)."""
        v = self.obj.get(name, 0)
        if isinstance(v, str) and 0 < len(v) <= 20 and v.lstrip("-").isdigit():
            v = int(v)
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            raise EtcdProtocolError(f"{self.where}: member {name!r} is not an integer in {lo}..{hi}")
        return v

    def bytes(self, name: str, *, max_bytes: int) -> bytes:
        """A base64 member (absent means empty)."""
        v = self.obj.get(name, "")
        if not isinstance(v, str) or len(v) > 4 * (max_bytes // 3 + 1):
            raise EtcdProtocolError(f"{self.where}: member {name!r} is not base64 of at most {max_bytes} bytes")
        try:
            return base64.b64decode(v, validate=True)
        except (binascii.Error, ValueError):
            raise EtcdProtocolError(f"{self.where}: member {name!r} is not valid base64") from None

    def kv(self, max_bytes: int) -> KeyValue:
        return KeyValue(self.bytes("key", max_bytes=max_bytes), self.bytes("value", max_bytes=max_bytes),
                        self.int("create_revision"), self.int("mod_revision"), self.int("lease", lo=-_INT64))


class EtcdClient:
    """etcd's v3 API at ``endpoint`` (see the module docstring). ``timeout_s``: the default bound of a call
    (connecting, sending and reading the whole reply); ``max_reply_bytes``: the largest reply body accepted.
    Raises ``ValueError`` for an endpoint that is not ``http(s)://HOST:PORT[,...]``."""

    def __init__(self, endpoint: str, *, timeout_s: float = 5.0, max_reply_bytes: int = 1 << 20):
        self.endpoints = parse_endpoints(endpoint)
        if timeout_s <= 0 or max_reply_bytes < 4096:
            raise ValueError("timeout_s must be positive and max_reply_bytes at least 4096")
        self.timeout_s, self.max_reply_bytes = timeout_s, max_reply_bytes
        self.cluster_id: int | None = None  # from the newest reply's header
        self.revision = 0  # the highest store revision seen in a reply's header
        self._good = 0

    def __repr__(self) -> str:
        return f"EtcdClient({self.endpoint!r})"

    @property
    def endpoint(self) -> str:
        return ",".join(e.url for e in self.endpoints)

    # ------------------------------------------------------------------------------------- leases

    async def grant(self, ttl_s: int, *, timeout_s: float | None = None) -> Lease:
        """A new lease of ``ttl_s`` seconds (etcd raises it to its minimum, 2 s on a default etcd)."""
        r = await self._call("/v3/lease/grant", {"TTL": int(ttl_s)}, timeout_s)
        if r.obj.get("error"):
            raise EtcdError(f"{r.where}: {str(r.obj['error'])[:200]}")
        return Lease(r.int("ID", lo=1), r.int("TTL", lo=1, hi=1 << 40))

    async def keepalive(self, lease_id: int, *, timeout_s: float | None = None) -> int:
        """Refresh lease ``lease_id``: the seconds it has left now (its full TTL), or 0 if it no longer exists."""
        r = await self._call("/v3/lease/keepalive", {"ID": str(lease_id)}, timeout_s, stream=True)
        res = r.sub("result")
        if res.int("ID", lo=-_INT64) != lease_id:
            raise EtcdProtocolError(f"{r.where}: the reply is about another lease")
        return res.int("TTL", lo=-_INT64, hi=1 << 40) if "TTL" in res.obj else 0

    async def revoke(self, lease_id: int, *, timeout_s: float | None = None) -> None:
        """Revoke lease ``lease_id`` (its keys are deleted); a lease that no longer exists is no error."""
        try:
            await self._call("/v3/lease/revoke", {"ID": str(lease_id)}, timeout_s)
        except LeaseNotFound:
            pass

    # ------------------------------------------------------------------------------------- keys

    async def put(self, key: bytes, value: bytes, *, lease: int = 0, timeout_s: float | None = None) -> int:
        """Write ``key`` (attached to ``lease``, 0: none); the store revision of the write."""
        body = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        r = await self._call("/v3/kv/put", body, timeout_s)
        return r.sub("header").int("revision")

    async def range_prefix(self, prefix: bytes, *, limit: int = 4096, timeout_s: float | None = None) -> list[KeyValue]:
        """The keys that start with ``prefix`` (at most ``limit``, in key order)."""
        if not prefix:
            raise ValueError("range_prefix needs a non-empty prefix")
        end = bytearray(prefix)
        while end and end[-1] == 0xFF:
            end.pop()
        end[-1] += 1
        r = await self._call("/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(bytes(end)), "limit": limit},
                             timeout_s)
        kvs = r.obj.get("kvs", [])
        if not isinstance(kvs, list) or len(kvs) > limit:
            raise EtcdProtocolError(f"{r.where}: kvs is not a list of at most {limit}")
        out = [_Reply(kv, f"{r.where}.kvs[{i}]").kv(self.max_reply_bytes) for i, kv in enumerate(kvs)]
        if any(not kv.key.startswith(prefix) for kv in out):
            raise EtcdProtocolError(f"{r.where}: a key outside the prefix asked for")
        return out

    # ------------------------------------------------------------------------------------- election

    async def campaign(self, name: bytes, lease_id: int, value: bytes) -> LeaderKey:
        """Stand in election ``name`` with ``value`` under lease ``lease_id``; returns once this caller leads
        (no timeout: cancel the call to withdraw, etcd then deletes the candidate key). Standing again with the
        same lease keeps the same key. Raises :class:`LeaseNotFound` if the lease is gone."""
        r = await self._call("/v3/election/campaign", {"name": _b64(name), "lease": str(lease_id),
                                                      "value": _b64(value)}, None, long=True)
        lk = self._leader_key(r.sub("leader"))
        if lk.name != name or lk.lease != lease_id:
            raise EtcdProtocolError(f"{r.where}: the reply names another election or lease")
        return lk

    async def leader(self, name: bytes, *, timeout_s: float | None = None) -> tuple[KeyValue | None, int]:
        """``(key, revision)``: the leader's key in election ``name`` (None: nobody leads) and the store revision
        the answer is from (a reply older than a caller's own campaign is recognised by it)."""
        before = self.revision
        try:
            r = await self._call("/v3/election/leader", {"name": _b64(name)}, timeout_s)
        except EtcdError as exc:
            if exc.reason != NO_LEADER or isinstance(exc, EtcdUnavailable):
                raise
            return None, before  # (an error reply has no header: the answer is at least as new as the request)
        kv = r.sub("kv").kv(self.max_reply_bytes)
        if not kv.key.startswith(name + b"/"):
            raise EtcdProtocolError(f"{r.where}: the leader's key is outside the election")
        return kv, r.sub("header").int("revision")

    async def observe(self, name: bytes):
        """Async iterator of the leader's key in election ``name``: the current one, then each new one (no
        timeout; end it by closing the iterator). Raises as :meth:`leader` (:class:`EtcdUnavailable` when the
        stream breaks)."""
        path = "/v3/election/observe"
        ex = await Exchange.open(self._order()[0], timeout_s=self.timeout_s, long=True,
                                 max_reply_bytes=self.max_reply_bytes)
        try:
            async for obj in ex.stream(path, {"name": _b64(name)}):
                r = _Reply(obj, ex.where(path))
                self._note_header(r)
                kv = r.sub("result").sub("kv").kv(self.max_reply_bytes)
                if not kv.key.startswith(name + b"/"):
                    raise EtcdProtocolError(f"{ex.where(path)}: a key outside the election")
                yield kv
        finally:
            ex.close()

    async def resign(self, leader: LeaderKey, *, timeout_s: float | None = None) -> None:
        """Give up the lead ``leader`` holds (its key is deleted, the next candidate leads)."""
        await self._call("/v3/election/resign", {"leader": {"name": _b64(leader.name), "key": _b64(leader.key),
                                                            "rev": str(leader.rev), "lease": str(leader.lease)}},
                         timeout_s)

    def _leader_key(self, r: _Reply) -> LeaderKey:
        m = self.max_reply_bytes
        return LeaderKey(r.bytes("name", max_bytes=m), r.bytes("key", max_bytes=m), r.int("rev", lo=1),
                         r.int("lease", lo=-_INT64))

    # ------------------------------------------------------------------------------------- calls

    def _order(self) -> list:
        return self.endpoints[self._good:] + self.endpoints[:self._good]

    async def _call(self, path: str, body: dict, timeout_s: float | None, *, stream: bool = False,
                    long: bool = False) -> _Reply:
        """POST ``body`` to ``path`` on the first endpoint that answers; the reply (the first message of a
        streamed one), its header's revision and cluster id recorded. ``timeout_s`` None: :attr:`timeout_s`,
        except for a ``long`` call (no bound)."""
        bound = None if long and timeout_s is None else (timeout_s or self.timeout_s)
        failures = []
        for ep in self._order():
            try:
                obj = await asyncio.wait_for(self._once(ep, path, body, stream, long), bound)
            except asyncio.TimeoutError:
                failures.append(f"etcd at {ep.url}: no answer within {bound:g} s")
                continue
            except EtcdUnavailable as exc:
                failures.append(str(exc))
                continue
            self._good = self.endpoints.index(ep)
            reply = _Reply(obj, f"etcd at {ep.url}: {path}")
            self._note_header(reply)
            return reply
        raise EtcdUnavailable(f"{path}: " + "; ".join(failures))

    async def _once(self, ep, path: str, body: dict, stream: bool, long: bool) -> dict:
        ex = await Exchange.open(ep, timeout_s=self.timeout_s, long=long, max_reply_bytes=self.max_reply_bytes)
        try:
            if not stream:
                return await ex.unary(path, body)
            messages = ex.stream(path, body)
            try:
                async for obj in messages:
                    return obj
            finally:
                await messages.aclose()
            raise EtcdUnavailable(f"{ex.where(path)}: the stream ended without a reply")
        finally:
            ex.close()

    def _note_header(self, r: _Reply) -> None:
        h = r.sub("header", required=False)
        if h is None and isinstance(r.obj.get("result"), dict):
            h = _Reply(r.obj["result"], r.where).sub("header", required=False)
        if h is not None:
            self.cluster_id = h.int("cluster_id", hi=(1 << 64) - 1)
            self.revision = max(self.revision, h.int("revision"))
