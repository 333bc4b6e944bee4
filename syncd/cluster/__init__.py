"""The cluster layer of syncd: many nodes behind one long link to the object store.

One controller (elected among the live nodes, or through etcd) plans each new version; each shard is read from
the store by one node (its root) and spread to the others by a pipelined tree broadcast over authenticated TCP,
into each node's local disk cache. See ``docs/cluster.md``.

Modules: :mod:`~syncd.cluster.membership` (who is in the cluster, who is alive),
:mod:`~syncd.cluster.election` (the embedded election of the controller), :mod:`~syncd.cluster.etcd_election`
(membership and the controller through etcd, with fencing by term; its client :mod:`~syncd.cluster.etcd` and
:mod:`~syncd.cluster.etcd_gateway`), :mod:`~syncd.cluster.planner` (roots and trees),
:mod:`~syncd.cluster.wire` (frames), :mod:`~syncd.cluster.auth` (the cluster secret, handshake),
:mod:`~syncd.cluster.partials` (partial shards and their chunk tags, on the node cache),
:mod:`~syncd.cluster.transfer` (pulls, store reads), :mod:`~syncd.cluster.node` (:class:`ClusterNode`) and its
roles :mod:`~syncd.cluster.heartbeats` (membership), :mod:`~syncd.cluster.fetching` (the relay) and
:mod:`~syncd.cluster.controller`, :mod:`~syncd.cluster.state` (the delivered version, the event log),
:mod:`~syncd.cluster.config` (settings), :mod:`~syncd.cluster.cli` (the ``python -m syncd.cluster.node``
process). Simulated clusters (network namespaces, shaped links, an S3 endpoint over a file store) are lab
code: :mod:`bench.netsim`.
"""

from __future__ import annotations

from syncd.lazy import lazy_names

_LAZY = {
    "ClusterNode": ("syncd.cluster.node", "ClusterNode"),
    "ClusterConfig": ("syncd.cluster.config", "ClusterConfig"),
    "NO_HISTORY": ("syncd.cluster.config", "NO_HISTORY"),
    "ClusterSecret": ("syncd.cluster.auth", "ClusterSecret"),
    "Member": ("syncd.cluster.membership", "Member"),
    "parse_peers": ("syncd.cluster.membership", "parse_peers"),
    "ClusterError": ("syncd.cluster.errors", "ClusterError"),
    "AuthError": ("syncd.cluster.errors", "AuthError"),
    "ProtocolError": ("syncd.cluster.errors", "ProtocolError"),
}

__all__ = sorted(_LAZY)


__getattr__ = lazy_names("syncd.cluster", _LAZY)
