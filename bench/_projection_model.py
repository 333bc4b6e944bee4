"""The projection model: the time from ``publish()`` to every engine serving one version, stage by stage, from
one-core rates measured on this machine and a deployment (links, hosts, cores, cluster, engines).

The stages are contiguous intervals of one version's critical path, in the order the real path hands a version
on -- the publisher commits a version's manifest only after every shard is up, the cluster's controller plans
only committed versions, a daemon stages only a version whose shards are all in its cache -- so the total is
their sum; what overlaps is overlapped *inside* a stage:

* ``encode``: ``publish()`` called to the last full shard cut: the snapshot copy and its check for NaN and
  infinities (``syncd.publish.finite``), then the delta encoded batch by batch (``syncd.publish``'s 32M-element
  batches) on the trainer host's cores, each shard hashed and handed to one of the ``upload_threads`` uploads --
  waiting while that many are in flight, which share the upload link, so a slow link slows the encode.
* ``upload``: the uploads still running after the last cut, then the manifest (the version becomes visible).
* ``long link``: the controller's poll notices the version (half a poll interval on average, plus the hint and
  manifest reads), sends the plan with the manifest to every node, and the roots read every shard from the store:
  the store's egress (the long link) is shared by all roots, each root's own link caps what it reads.
* ``broadcast``: from the last byte read from the store to the last node holding the version: the last chunk's
  way down the tree (half a chunk on average; a relay's link is shared by its ``fanout`` children, plus ``hop_s``
  per level), and whatever the links inside the cluster need beyond the long link (every node receives every
  byte on its own link).
* ``stage``: the daemon's round (the engine check: a lease call and a scrub of ``scrub_bytes`` of weights), the
  cached shards re-hashed by the daemon and again by each engine process that reads them, and staging on the
  engine while it serves: on a CPU engine the delta decoded against the engine's weights and the base checksum
  checked (one read pass); on GPU engines each GPU's worker process decodes its deltas on one host core and each
  GPU copies and checksums at HBM rate.
* ``pause``: apply the staged words, then the daemon's check of every parameter's checksum, while paused.

CPU work that every node does at the same time shares ``node_cores`` cores per node (in the validation: what the
simulated nodes' engines get of this machine's cores when they stage at once). Pure functions; no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

__all__ = ["Rates", "Setup", "stages", "tree_depth", "publish_times", "manifest_estimate", "link_Bps", "STAGES",
           "ENCODE_BATCH_ELEMS", "TCP_PAYLOAD"]

STAGES = ("encode", "upload", "long link", "broadcast", "stage", "pause")
ENCODE_BATCH_ELEMS = 1 << 25  # syncd.publish.publisher._ENCODE_BATCH_ELEMS
#: payload bytes TCP carries per byte on the wire (1448 of each 1514-byte Ethernet frame, with timestamps)
TCP_PAYLOAD = 1448 / 1514


def link_Bps(bits_per_s: float) -> float:
    """Payload bytes per second of a link of ``bits_per_s`` (what shaping or a NIC's rate counts)."""
    return bits_per_s / 8 * TCP_PAYLOAD


@dataclass(frozen=True)
class Rates:
    """One-core rates measured here at one density and codec format. Rates are bytes of bf16 weights per second
    unless named otherwise. ``delta_bytes_per_param``, ``changed_per_param``: the delta's size and changed words
    per parameter; ``encode``: ``delta.encode_many`` (what a trainer's publisher runs); ``stage``: a CPU engine's
    staging (``delta.changes`` with the base, then ``changed_words``: the base checksum pass and the new words);
    ``decode``: the host decode of an engine on GPUs (``delta.changes`` alone); ``apply``: the scatter of the
    staged words (verified); ``checksum``: ``checksum_many``; ``sha256``: bytes of shard data per second;
    ``copy``: the publisher's snapshot copy; ``finite``: its check that the snapshot holds no NaN or infinity
    (``syncd.publish.finite``); ``class_bytes_per_param``: what format 2's host decode needs copied from each GPU
    (0 for format 1)."""

    delta_bytes_per_param: float
    changed_per_param: float
    encode: float
    stage: float
    decode: float
    apply: float
    checksum: float
    sha256: float
    copy: float
    finite: float
    class_bytes_per_param: float = 0.0


@dataclass(frozen=True)
class Setup:
    """A deployment. Bytes per second for links (payload: :func:`link_Bps`), seconds for intervals.

    ``params`` parameters of ``weight_bytes_per_param`` bytes each (2: bf16). ``trainer_hosts``, ``trainer_cores``:
    hosts that publish (each its share of the weights) and the cores each one's work uses, up to ``host_mem_Bps`` of
    memory traffic (the encode reads 2 bytes per weight byte, the snapshot copy 2, the finite check 1);
    ``upload_Bps``: each trainer host's link to the store; ``long_Bps``: the store's egress towards the cluster;
    ``intra_Bps``: each node's link (both ways). ``nodes``, ``fanout``, ``chunk_bytes``: the cluster's;
    ``shard_bytes``, ``tensor_params``, ``upload_threads``: the publisher's; ``poll_s``: the controller's poll
    interval; ``manifest_bytes``: one version's manifest (None: :func:`manifest_estimate`); ``hop_s``: what a tree
    level adds beyond its chunk's transfer.

    ``engine``: ``"cpu"`` (one weights-only engine per node, its weights in host memory) or ``"gpu"``;
    ``node_cores``: the cores each node's host work gets while every node stages at once; ``pause_cores``: those
    the last engine's pause gets (None: ``node_cores``; stagings end at different times, so the last pause runs
    mostly alone); ``scrub_bytes``: weight bytes the round's engine check scrubs (the daemon's default per scrub,
    taken as due: one comes every ``--engine-scrub-s``); ``rpc_s``: one call from a daemon to its engine. GPU
    engines: ``gpus_per_node``, ``gpus_per_engine``, ``pcie_Bps``, ``hbm_Bps``, ``staged_bytes_per_change``, and
    ``decode_cores_per_gpu``: the host cores each GPU's engine process decodes its deltas on while it serves (at most
    the node's ``node_cores`` among them all)."""

    params: float
    weight_bytes_per_param: float = 2.0
    trainer_hosts: int = 1
    trainer_cores: float = 1.0
    host_mem_Bps: float = float("inf")
    upload_Bps: float = 1e9
    long_Bps: float = 1e9
    intra_Bps: float = 1e9
    nodes: int = 1
    fanout: int = 2
    chunk_bytes: float = 1 << 20
    shard_bytes: float = 64 << 20
    tensor_params: float = 1 << 24
    upload_threads: int = 4
    poll_s: float = 1.0
    manifest_bytes: float | None = None
    hop_s: float = 0.0
    engine: str = "gpu"
    node_cores: float = 32.0
    pause_cores: float | None = None
    scrub_bytes: float = 640 << 20
    rpc_s: float = 0.002
    gpus_per_node: int = 8
    gpus_per_engine: int = 16
    pcie_Bps: float = 40e9
    hbm_Bps: float = 3.5e12
    staged_bytes_per_change: float = 6.0
    decode_cores_per_gpu: float = 1.0

    def with_(self, **kw) -> "Setup":
        return replace(self, **kw)


def manifest_estimate(tensors: float, shards: float) -> float:
    """Bytes of a manifest naming ``tensors`` tensors in ``shards`` shards (the signed JSON of ``syncd.manifest``:
    about 170 bytes per tensor entry, 220 per shard entry, 1 kB besides)."""
    return 1000 + 170 * tensors + 220 * shards


def tree_depth(nodes: int, fanout: int) -> int:
    """Levels below the root of a fanout tree over ``nodes`` positions (heap order, as the planner builds)."""
    depth, p = 0, nodes - 1
    while p > 0:
        p = (p - 1) // fanout
        depth += 1
    return depth


def publish_times(weights: float, delta: float, shard: float, encode_Bps: float, sha_Bps: float, upload_Bps: float,
                  threads: int, batch_bytes: float) -> tuple[float, float]:
    """``(encode, upload)`` seconds of one publisher (see the module docstring): ``weights`` bytes encoded at
    ``encode_Bps`` in batches of ``batch_bytes``, each batch's share of the ``delta`` bytes cut into shards of
    ``shard`` bytes as they fill, hashed at ``sha_Bps`` and uploaded over one link of ``upload_Bps`` that the uploads
    in flight share equally (as TCP flows do); a cut waits while ``threads`` uploads are in flight. The last, partial
    shard is cut after the encode (in the upload)."""
    batches = max(1, math.ceil(weights / batch_bytes))
    flight: list[float] = []  # bytes each upload in flight has left
    t, carry = 0.0, 0.0

    def advance(dt: float) -> None:  # the link works on the uploads in flight for dt seconds
        nonlocal flight
        while dt > 1e-12 and flight:
            step = min(dt, min(flight) * len(flight) / upload_Bps)
            flight = [b - step * upload_Bps / len(flight) for b in flight]
            flight = [b for b in flight if b > 1e-6]
            dt -= step

    def busy(dt: float) -> None:  # the publisher works for dt seconds while the uploads go on
        nonlocal t
        advance(dt)
        t += dt

    def cut(size: float) -> None:
        busy(size / sha_Bps)
        while len(flight) >= threads:
            busy(min(flight) * len(flight) / upload_Bps)
        flight.append(size)

    for _ in range(batches):
        busy(weights / batches / encode_Bps)
        carry += delta / batches
        while carry >= shard:
            carry -= shard
            cut(shard)
    encoded = t
    if carry > 0:
        cut(carry)
    while flight:
        busy(min(flight) * len(flight) / upload_Bps)
    return encoded, t - encoded


def _long_link(s: Setup, delta: float, shards: int, shard: float) -> tuple[float, float]:
    """``(seconds, store-read seconds)``: the poll noticing the version, the plan sent, the roots' store reads."""
    detect = s.poll_s / 2 + s.manifest_bytes / s.long_Bps
    plan = (s.nodes - 1) * s.manifest_bytes / s.intra_Bps
    per_root = math.ceil(shards / s.nodes) * shard  # least-loaded roots: the mean plus at most one shard
    reads = max(delta / s.long_Bps, min(per_root, delta) / s.intra_Bps)
    return detect + plan + reads, reads


def _broadcast(s: Setup, delta: float, shard: float, reads: float) -> float:
    """The tree's time past the last store read (see the module docstring)."""
    if s.nodes <= 1:
        return 0.0
    hop = min(s.chunk_bytes, shard) / 2 * s.fanout / s.intra_Bps  # a relay's last chunk (half full on average)
    intra = delta / s.intra_Bps  # every node receives every byte, from the store or a peer, on its own link
    return tree_depth(s.nodes, s.fanout) * (hop + s.hop_s) + max(0.0, intra - reads)


def _engine_cpu(s: Setup, r: Rates, weights: float, delta: float) -> tuple[float, float]:
    """``(stage, pause)`` of one weights-only CPU engine per node, every node at once on ``node_cores`` each: the
    daemon's engine check (a scrub) and its re-hash of the cached shards, the engine's read of them (hashed again)
    and its staging; the pause: the apply, then the daemon's checksum of every parameter."""
    check = min(s.scrub_bytes, weights) / r.checksum
    stage = check + 2 * delta / r.sha256 + weights / r.stage
    pause = weights / r.apply + weights / r.checksum
    return stage / s.node_cores + 3 * s.rpc_s, pause / (s.pause_cores or s.node_cores) + 5 * s.rpc_s


def _engine_gpu(s: Setup, r: Rates, weights: float, delta: float) -> tuple[float, float]:
    """``(stage, pause)`` of GPU engines (one worker process per GPU, as vLLM's): the daemon re-hashes the cached
    shards on the node's cores; each worker reads every shard (hashed, 4 threads) and decodes the deltas of the
    weights its GPU holds on ``decode_cores_per_gpu`` cores (the node's cores at most); format 2's classes cross
    PCIe; each GPU copies and checksums its base and result at HBM rate. The pause: the staged words over PCIe, their scatter, and the daemon's checksum of the
    weights (HBM rate)."""
    node_weights = weights * min(1.0, s.gpus_per_node / s.gpus_per_engine)
    per_gpu = node_weights / s.gpus_per_node
    procs = min(s.node_cores, s.gpus_per_node)
    hashing = delta / (r.sha256 * s.node_cores) + delta / (r.sha256 * min(4.0, s.node_cores / procs))
    decoding = min(s.node_cores, s.gpus_per_node * s.decode_cores_per_gpu)
    stage = (hashing + node_weights / (r.decode * decoding) + per_gpu / 2 * r.class_bytes_per_param / s.pcie_Bps
             + 4 * per_gpu / s.hbm_Bps + min(s.scrub_bytes, per_gpu) / s.hbm_Bps)
    changed_per_gpu = s.params * r.changed_per_param / s.gpus_per_engine
    pause = (changed_per_gpu * s.staged_bytes_per_change / s.pcie_Bps + changed_per_gpu * 64 / s.hbm_Bps
             + per_gpu / s.hbm_Bps)
    return stage + 3 * s.rpc_s, pause + 5 * s.rpc_s


def stages(s: Setup, r: Rates) -> dict:
    """Seconds of each stage (:data:`STAGES`) and ``total`` (their sum), with the sizes they came from."""
    weights = s.weight_bytes_per_param * s.params
    delta = s.params * r.delta_bytes_per_param
    per_tensor = min(delta * s.tensor_params / s.params, delta)
    # a shard holds the whole tensors' blobs that fit in shard_bytes, or one bigger blob alone
    shard = per_tensor * max(1, math.floor(s.shard_bytes / per_tensor)) if per_tensor > 0 else s.shard_bytes
    shards = max(1, math.ceil(delta / shard))
    if s.manifest_bytes is None:
        s = s.with_(manifest_bytes=manifest_estimate(s.params / s.tensor_params, shards))
    host = lambda rate, touched: min(rate * s.trainer_cores, s.host_mem_Bps / touched)  # noqa: E731
    enc, up = publish_times(weights / s.trainer_hosts, delta / s.trainer_hosts, shard, host(r.encode, 2.0),
                            r.sha256, s.upload_Bps, s.upload_threads, 2.0 * ENCODE_BATCH_ELEMS)
    enc += weights / s.trainer_hosts * (1 / host(r.copy, 2.0) + 1 / host(r.finite, 1.0))
    long_s, reads = _long_link(s, delta, shards, shard)
    bcast = _broadcast(s, delta, shard, reads)
    stage, pause = (_engine_cpu if s.engine == "cpu" else _engine_gpu)(s, r, weights, delta)
    out = {"encode": enc, "upload": up + s.manifest_bytes / s.upload_Bps, "long link": long_s, "broadcast": bcast,
           "stage": stage, "pause": pause}
    return {"stages_s": out, "total_s": sum(out.values()), "delta_bytes": delta, "weights_bytes": weights,
            "shards": shards, "shard_bytes": shard, "manifest_bytes": s.manifest_bytes,
            "tree_depth": tree_depth(s.nodes, s.fanout)}
