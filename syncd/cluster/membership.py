"""Who is in the cluster, and who is alive.

Members are found from a static list (``--peers 0=host:port,1=host:port,...``), from a directory in the
object store (``--peers-from-store CLUSTER``), or from etcd (``--etcd URL``, :mod:`syncd.cluster.etcd_election`).
In the store directory each node writes ``clusters/<cluster>/members/<rank:06d>.json`` = :func:`record`
``{"rank", "host", "port", "incarnation", "mac"}`` (the MAC, keyed by the cluster secret, covers the rest, so a
record written by anyone else is ignored) and lists the directory every ``discover_s`` seconds; in etcd the same
record is a key under the node's lease. A record is only an address.

Liveness: every node sends a heartbeat to every other node every ``heartbeat_s`` seconds (a few hundred
bytes; :mod:`syncd.cluster.node`); a node not heard from for ``dead_after_s`` (default three periods) is
dead. A heartbeat carries the sender's *incarnation* (random per process start), so a node that restarted
is seen as new even if it was never missed. With etcd a node is live only while its lease is alive too
(:attr:`Membership.registered`): a node etcd has dropped is out of the plans even if some peer still hears it.

:class:`Membership` is used from one asyncio loop (not thread-safe).
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass, field

from syncd.cluster import wire
from syncd.cluster.auth import ClusterSecret
from syncd.cluster.errors import ProtocolError

log = logging.getLogger(__name__)

_CLUSTER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MAX_MEMBERS = 4096


@dataclass(frozen=True)
class Member:
    """A node's rank and the address its daemon listens on."""

    rank: int
    host: str
    port: int


def parse_peers(text: str) -> dict[int, Member]:
    """``"0=10.0.0.1:7400,1=10.0.0.2:7400"`` (also ``[::1]:7400``) -> ``{rank: Member}``; ``ValueError``."""
    out: dict[int, Member] = {}
    for item in filter(None, (p.strip() for p in text.replace("\n", ",").split(","))):
        try:
            rank_s, addr = item.split("=", 1)
            host, port_s = addr.rsplit(":", 1)
            rank, port = int(rank_s), int(port_s)
        except ValueError:
            raise ValueError(f"peer {item!r} is not RANK=HOST:PORT") from None
        host = host.strip("[]")
        if not 0 <= rank < 1 << 31 or not 0 < port < 65536 or not host:
            raise ValueError(f"peer {item!r}: rank or port out of range")
        if rank in out:
            raise ValueError(f"rank {rank} appears twice in the peer list")
        out[rank] = Member(rank, host, port)
    if not out:
        raise ValueError("the peer list is empty")
    return out


def check_cluster_id(name: str) -> str:
    if not isinstance(name, str) or not _CLUSTER_RE.match(name) or ".." in name:
        raise ValueError(f"invalid cluster id {name!r}: use 1-128 of [A-Za-z0-9._-], starting alphanumeric")
    return name


def member_key(cluster: str, rank: int) -> str:
    return f"clusters/{check_cluster_id(cluster)}/members/{rank:06d}.json"


def _record_mac(secret: ClusterSecret, body: dict) -> str:
    return secret.mac(b"syncd.cluster.member.v1", json.dumps(body, sort_keys=True).encode()).hex()


def record(me: Member, incarnation: str, secret: ClusterSecret) -> bytes:
    """This node's member record: ``{"rank", "host", "port", "incarnation", "mac"}``, the MAC by the cluster
    secret over the rest (written to the store directory or to etcd)."""
    body = {"rank": me.rank, "host": me.host, "port": me.port, "incarnation": incarnation}
    return json.dumps({**body, "mac": _record_mac(secret, body)}).encode()


def parse_record(raw: bytes, where: str, secret: ClusterSecret) -> Member:
    """The member a record (:func:`record`) names, after its checks: bounded strict JSON, the MAC by this
    cluster's secret, every field in range. Raises :class:`ProtocolError` saying what is wrong."""
    doc = wire.parse_json(raw, where, max_bytes=4096)
    try:
        body = {k: doc[k] for k in ("rank", "host", "port", "incarnation")}
    except KeyError as exc:
        raise ProtocolError(f"{where}: member {exc} missing") from None
    if not isinstance(doc.get("mac"), str) or doc["mac"] != _record_mac(secret, body):
        raise ProtocolError(f"{where}: record not signed with this cluster's secret")
    rank, host, port = body["rank"], body["host"], body["port"]
    if (not isinstance(rank, int) or not isinstance(port, int) or not isinstance(host, str)
            or not 0 <= rank < 1 << 31 or not 0 < port < 65536 or not 0 < len(host) <= 255):
        raise ProtocolError(f"{where}: record fields out of range")
    return Member(rank, host, port)


def register(store, cluster: str, me: Member, incarnation: str, secret: ClusterSecret) -> None:
    """Write (overwrite) this node's record in the store directory. Blocking (call in a thread)."""
    store.put(member_key(cluster, me.rank), record(me, incarnation, secret))


def discover(store, cluster: str, secret: ClusterSecret) -> dict[int, Member]:
    """Every valid record in the store directory. Records that are malformed, oversized or not MAC'd with
    this cluster's secret are skipped (and logged). Blocking (call in a thread)."""
    prefix = f"clusters/{check_cluster_id(cluster)}/members/"
    out: dict[int, Member] = {}
    for info in store.list(prefix)[:MAX_MEMBERS]:
        try:
            m = parse_record(store.get(info.key, limit=4097), f"member record {info.key}", secret)
            if info.key != member_key(cluster, m.rank):
                raise ProtocolError("record stored under another rank's key")
            out[m.rank] = m
        except Exception as exc:  # noqa: BLE001 - a bad record must not stop discovery
            log.warning("cluster %s: ignoring member record %s: %s", cluster, info.key, exc)
    return out


@dataclass
class PeerState:
    """What this node last heard from a peer: when (monotonic seconds) and its heartbeat."""

    heard: float = float("-inf")
    incarnation: str | None = None
    info: dict = field(default_factory=dict)


class Membership:
    """Known members and their liveness as seen by node ``me``. ``registered``: with etcd, the ranks whose lease
    is alive (their member key is in etcd, as last read); None without etcd."""

    def __init__(self, me: int, members: dict[int, Member], *, dead_after_s: float):
        if me not in members:
            raise ValueError(f"rank {me} is not in the member list {sorted(members)}")
        self.me = me
        self.members = dict(members)
        self.dead_after_s = dead_after_s
        self.peers: dict[int, PeerState] = {}
        self.restarts: dict[int, int] = {}
        self.registered: set[int] | None = None

    def add(self, members: dict[int, Member]) -> list[int]:
        """Merge newly discovered members; returns the ranks that are new or changed address."""
        changed = [r for r, m in members.items() if self.members.get(r) != m and r != self.me]
        for r in changed:
            self.members[r] = members[r]
        return changed

    def heard(self, rank: int, info: dict, now: float | None = None) -> bool:
        """Record a heartbeat from ``rank``; True if that peer restarted (new incarnation)."""
        st = self.peers.setdefault(rank, PeerState())
        inc = info.get("inc")
        restarted = st.incarnation is not None and inc != st.incarnation
        if restarted:
            self.restarts[rank] = self.restarts.get(rank, 0) + 1
        st.heard, st.incarnation, st.info = (time.monotonic() if now is None else now), inc, info
        return restarted

    def live(self, now: float | None = None) -> list[int]:
        """Ranks alive now: this node, and every peer heard from within ``dead_after_s`` (with etcd: and
        :attr:`registered`)."""
        now = time.monotonic() if now is None else now
        return sorted({self.me} | {r for r, st in self.peers.items()
                                   if r in self.members and now - st.heard < self.dead_after_s
                                   and (self.registered is None or r in self.registered)})

    def info(self, rank: int) -> dict:
        st = self.peers.get(rank)
        return st.info if st is not None else {}
