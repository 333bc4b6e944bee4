"""Settings of one cluster node (:class:`ClusterConfig`), shared by :class:`syncd.cluster.ClusterNode`, the
standalone process (:mod:`syncd.cluster.cli`) and the node daemon's ``--cluster-*`` flags."""

from __future__ import annotations

from dataclasses import dataclass

from syncd.cluster import membership, wire

ENV_PREFIX = "SYNCD_CLUSTER_"
#: ``ClusterNode(delivered=NO_HISTORY)``: this node's engines hold no version; ignore ``state.json`` and start
#: at the newest full version the controller names (a node daemon whose engines are fresh).
NO_HISTORY = -1


@dataclass
class ClusterConfig:
    """Settings of one node; times in seconds, sizes in bytes.

    ``rank``: this node's rank (unique in the cluster). ``peers``: the static member list
    (``{rank: Member}``, this node included), or ``cluster_id`` to find members in the store directory
    ``clusters/<cluster_id>/members/`` (then ``advertise`` is this node's address there). ``listen``:
    ``(host, port)`` to bind (default: this node's member address). ``fanout``: children per tree node.
    ``chunk_bytes``: the unit of hashing and forwarding. ``store_streams``: shards read from the store at
    once, cluster-wide (0: no pacing, every root reads at once -- best when roots stream; with
    ``verify_first`` a small number keeps shards arriving one after another). ``pull_window``: shards a
    node pulls at once. ``stall_s``: a source that sends no
    chunk for that long (while the shard exists upstream) is abandoned for another. ``store_fallback_s``:
    how long a node with no live source waits for a new plan before it reads the shard from the store itself.
    ``pace_timeout_s``: a root stops waiting for earlier shards' reads after that long without progress.
    ``slow_fraction``: a node whose children receive from it at less than this fraction of the cluster's
    median rate is marked slow (moved to the leaves). ``throttle_bps``: cap this node's upload (tests and
    benchmarks). ``fsync``: fsync each shard before it is moved into ``shards/``. ``verify_first``: a
    root checks a whole shard against the manifest before it forwards any chunk (default: it streams, see
    :mod:`syncd.cluster.transfer`). ``etcd``: etcd client URL(s), comma-separated: membership is then a lease per
    node and the controller is elected through etcd, with fencing by term (:mod:`syncd.cluster.etcd_election`;
    None: the embedded election, :mod:`syncd.cluster.election`). ``etcd_ttl_s``: that lease's TTL in whole
    seconds (at least 2, etcd's minimum): a dead controller is replaced about that long after its last
    keepalive."""

    rank: int
    peers: dict | None = None
    cluster_id: str | None = None
    advertise: tuple | None = None
    listen: tuple | None = None
    heartbeat_s: float = 1.0
    dead_after_s: float | None = None
    poll_s: float = 1.0
    discover_s: float = 10.0
    fanout: int = 2
    chunk_bytes: int = 1 << 20
    store_streams: int = 0
    pull_window: int = 16
    stall_s: float = 5.0
    store_fallback_s: float = 30.0
    pace_timeout_s: float = 10.0
    slow_fraction: float = 0.2
    verify_first: bool = False
    throttle_bps: float | None = None
    fsync: bool = True
    connect_timeout_s: float = 5.0
    etcd: str | None = None
    etcd_ttl_s: int = 5

    def __post_init__(self):
        if self.dead_after_s is None:
            self.dead_after_s = 3 * self.heartbeat_s
        if self.peers is None and self.cluster_id is None and not self.etcd:
            raise ValueError("give the members: a static peer list, a store directory (cluster_id) or etcd")
        if self.cluster_id is not None:
            membership.check_cluster_id(self.cluster_id)
        if self.peers is None and self.advertise is None:
            raise ValueError("a node found through the store directory or etcd needs an advertised host:port")
        if self.etcd:
            from syncd.cluster.etcd_gateway import parse_endpoints

            parse_endpoints(self.etcd)
            if not isinstance(self.etcd_ttl_s, int) or not 2 <= self.etcd_ttl_s <= 3600:
                raise ValueError("etcd_ttl_s must be a whole number of seconds in 2..3600")
        if not 4096 <= self.chunk_bytes <= wire.MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in 4096..{wire.MAX_CHUNK_BYTES}")
        if not 1 <= self.fanout <= 64 or self.store_streams < 0 or self.pull_window < 1:
            raise ValueError("fanout must be 1..64, store_streams >= 0, pull_window >= 1")
        if self.heartbeat_s <= 0 or self.dead_after_s <= self.heartbeat_s:
            raise ValueError("heartbeat_s must be positive and dead_after_s longer than one heartbeat")
