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


def shard_roots(c, ranks) -> dict[tuple[int, int], set[tuple[int, int]]]:
    """``{(version, shard index): {(rank, incarnation)}}``: every node incarnation that took a plan naming
    it the shard's root (from its own event log, which spans its restarts)."""
    out: dict[tuple[int, int], set[tuple[int, int]]] = {}
    for r in ranks:
        inc = -1
        for e in c.events(r):
            if e["ev"] == "start":
                inc += 1
            elif e["ev"] == "plan":
                for i, root in enumerate(e["shard_roots"]):
                    if root == r:
                        out.setdefault((e["v"], i), set()).add((r, inc))
    return out


def store_log_reads(store_log, ip_rank: dict) -> list[dict]:
    """The shard reads of a simulated store's log (:func:`bench.netsim.read_store_log`) as
    ``{"key", "bytes", "rank"}`` (the reader's rank from its address)."""
    return [{"key": e["key"], "bytes": e["bytes"], "rank": ip_rank.get(e["peer"])} for e in store_log
            if "/shards/" in e["key"]]


def event_reads(c, ranks, store, versions: int) -> list[dict]:
    """The shard reads the nodes logged themselves (``store_read`` events; a read cut short by the node's
    death is missing) as ``{"key", "bytes", "rank"}``."""
    from syncd.versions import read_manifest

    key_of = {(v, s.sha256[:16]): f"runs/{RUN}/{s.key}" for v in range(versions)
              for s in read_manifest(store, RUN, v, signing_key=KEY).shards}
    return [{"key": key_of[(e["v"], e["sha"])], "bytes": e["bytes"], "rank": r} for r in ranks
            for e in c.events(r, "store_read") if e["v"] < versions]


def assert_store_reads_by_roots(c, reads, store, versions: int, ranks) -> None:
    """Every shard of versions ``0..versions-1`` was read from the store at most once per root incarnation
    it had (a root resumes where it stopped; a root that takes over from one that died or was too slow
    reads it again), and only by its roots. ``reads``: :func:`store_log_reads` or :func:`event_reads`."""
    from syncd.versions import read_manifest

    roots = shard_roots(c, ranks)
    for v in range(versions):
        for i, s in enumerate(read_manifest(store, RUN, v, signing_key=KEY).shards):
            mine = [e for e in reads if e["key"] == f"runs/{RUN}/{s.key}"]
            got, who = sum(e["bytes"] for e in mine), roots.get((v, i), set())
            assert got <= s.size * len(who), (
                f"version {v} shard {i}: the store served {got} bytes for {s.size}; roots {sorted(who)}")
            readers = {e["rank"] for e in mine if e["bytes"]}
            assert readers <= {r for r, _ in who}, f"version {v} shard {i}: read by {readers}, roots {sorted(who)}"
