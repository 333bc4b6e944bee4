"""Helpers of the cluster tests: publishing real versions, materializing weights from a node's cache."""

from __future__ import annotations

from pathlib import Path

from syncd.ops import checksum
from syncd.store import Store
from syncd.versions import apply_delta, load_full, resolve_chain

KEY = "cluster-test-signing-key-0123456789"
SECRET = "hex:" + "5e" * 32
RUN = "crun"


def cached_shards(cache_root, m) -> list[bytearray]:
    """The shards of manifest ``m`` from a node's cache (``<cache_root>/shards/<sha256>``)."""
    return [bytearray(Path(cache_root, "shards", s.sha256).read_bytes()) for s in m.shards]


def weights_from_cache(cache_root, store, version: int, run: str = RUN) -> dict:
    """Rebuild ``version`` from the newest full version before it plus the deltas after it, reading every
    shard from the node's cache (the store only gives the small manifests)."""
    chain = resolve_chain(Store.open(store), run, version, signing_key=KEY)
    weights = load_full(chain[0], cached_shards(cache_root, chain[0]))
    for base, m in zip(chain, chain[1:]):
        apply_delta(weights, base, m, cached_shards(cache_root, m))
    return weights


def assert_checksums_equal(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for k in want:
        assert checksum(got[k]) == checksum(want[k]), f"tensor {k} differs"


def version_bytes(store, version: int, run: str = RUN) -> int:
    from syncd.versions import read_manifest

    return read_manifest(store, run, version, signing_key=KEY).total_bytes


def store_reads(c, ranks) -> dict[int, int]:
    """Shard bytes read from the store, per version, summed over the nodes' event logs."""
    out: dict[int, int] = {}
    for r in ranks:
        for e in c.events(r, "store_read"):
            out[e["v"]] = out.get(e["v"], 0) + e["bytes"]
    return out


def segments(c, rank) -> list[list[int]]:
    """Delivered versions of each incarnation of a node (its event log spans restarts)."""
    segs: list[list[int]] = []
    for e in c.events(rank):
        if e["ev"] == "start":
            segs.append([])
        elif e["ev"] == "delivered":
            segs[-1].append(e["v"])
    return segs


def assert_in_order(c, rank) -> None:
    for seg in segments(c, rank):
        assert seg == list(range(seg[0], seg[0] + len(seg))) if seg else True, f"node {rank} delivered {seg}"


def assert_no_task_errors(c, ranks) -> None:
    """No long-lived task, shard worker or connection handler of any node raised what it did not expect."""
    errors = [(r, e["task"], e["why"]) for r in ranks for e in c.events(r, "task_error")]
    assert not errors, f"tasks that failed: {errors}"
