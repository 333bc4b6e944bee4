"""The planner: balanced, stable roots; trees with the configured fan-out that spread the upload; slow
nodes at the leaves; plans received from the network are checked against their manifest."""

from __future__ import annotations

import pytest

from syncd import manifest as mf
from syncd.cluster.errors import ProtocolError
from syncd.cluster.planner import Plan, plan_version


def manifest(sizes, version=1) -> mf.Manifest:
    shards = tuple(mf.ShardEntry(f"versions/{version:012d}/shards/{'a' * 16}-{i:05d}.safetensors", sz,
                                 f"{i + 1:064x}", "safetensors") for i, sz in enumerate(sizes))
    return mf.Manifest("r", version, "full", None, None, 0, "2026-01-01T00:00:00.000000Z", "a" * 16, (), shards)


def uploads(plan: Plan) -> dict[int, int]:
    out = {r: 0 for r in plan.members}
    for s in plan.shards:
        for r in s.order:
            out[r] += s.size * len(s.children(r, plan.fanout))
    return out


@pytest.mark.parametrize("n,fanout", [(2, 2), (5, 2), (16, 2), (16, 3), (9, 1)])
def test_roots_balanced_by_bytes_and_trees_span_every_member(n, fanout):
    sizes = [(i * 7919) % 50000 + 1000 for i in range(40)]
    m = manifest(sizes)
    p = plan_version(m, live=range(n), needers=range(n), fanout=fanout)
    loads = p.roots()
    assert max(loads.values()) <= sum(sizes) / n + max(sizes), "LPT: no root above mean + one shard"
    assert len(loads) == n, "every node reads part of the version from the store"
    for s in p.shards:
        assert sorted(s.order) == list(range(n)) and s.order[0] == s.root
        assert all(len(s.children(r, fanout)) <= fanout for r in s.order)
        for r in s.order[1:]:  # every node's ancestors lead to the root
            assert s.ancestors(r, fanout)[-1] == s.root
    assert sorted(s.fetch_rank for s in p.shards) == list(range(len(sizes)))
    assert [m.shards[s.index].size for s in sorted(p.shards, key=lambda s: s.fetch_rank)] == sorted(sizes, reverse=True)
    up = uploads(p)
    ideal = sum(sizes) * (n - 1) / n
    assert max(up.values()) <= 1.25 * ideal + max(sizes) * fanout, f"upload spread evenly: {up}"


def test_two_big_trees_have_different_interior_nodes():
    m = manifest([8 << 20, 8 << 20, 1 << 20])
    p = plan_version(m, live=range(16), needers=range(16), fanout=2)
    a, b = (s for s in p.shards if s.size == 8 << 20)
    interior = lambda s: {r for r in s.order if s.children(r, 2)}  # noqa: E731
    assert not (interior(a) & interior(b)), "the two big trees use disjoint uplinks"


def test_deterministic_and_stable_when_a_node_leaves():
    m = manifest([30000, 20000, 20000, 10000, 10000, 5000, 5000, 5000])
    p1 = plan_version(m, live=range(4), needers=range(4))
    assert plan_version(m, live=range(4), needers=range(4)) == p1
    p2 = plan_version(m, live=[0, 1, 3], needers=[0, 1, 3], prev=p1)
    for a, b in zip(p1.shards, p2.shards):
        if a.root != 2:
            assert b.root == a.root, "shards of live roots stay where they were"
        else:
            assert b.root in (0, 1, 3)
        assert 2 not in b.order


def test_holders_become_roots_and_slow_nodes_become_leaves():
    m = manifest([1000] * 6)
    holders = {m.shards[0].sha256: {3}}
    p = plan_version(m, live=range(5), needers=[4], holders=holders)
    assert p.shards[0].root == 3, "a node already holding a shard serves it: no store read"
    p = plan_version(m, live=range(7), needers=range(7), slow=[2], fanout=2)
    for s in p.shards:
        assert s.root != 2 and not s.children(2, 2), "the slow node is a leaf, never a root"


def test_a_dead_roots_shards_go_to_the_nodes_with_the_longest_prefix():
    m = manifest([40000, 30000, 20000])
    p1 = plan_version(m, live=range(4), needers=range(4))
    dead = p1.shards[0].root
    left = [r for r in range(4) if r != dead]
    partial = {m.shards[0].sha256: {left[0]: 8192, left[2]: 24576, dead: 40000}}
    p2 = plan_version(m, live=left, needers=left, prev=p1, partial=partial)
    assert p2.shards[0].root == left[2], "its successor reads only the 15424 bytes it lacks from the store"
    partial[m.shards[0].sha256][left[1]] = 24576  # a tie: the less loaded of the two
    p3 = plan_version(m, live=left, needers=left, prev=p1, partial=partial)
    loads = {r: sum(s.size for s in p1.shards if s.root == r) for r in (left[1], left[2])}
    assert p3.shards[0].root == min(loads, key=lambda r: (loads[r], r))
    holders = {m.shards[0].sha256: {left[0]}}  # a complete copy beats any prefix
    assert plan_version(m, live=left, needers=left, prev=p1, partial=partial, holders=holders).shards[0].root == left[0]


def test_plan_round_trip_and_hostile_plans():
    m = manifest([100, 200, 300])
    p = plan_version(m, live=[0, 5, 9], needers=[0, 5, 9], term=3, seq=7)
    assert Plan.from_json(p.to_json(), m, max_chunk_bytes=1 << 24) == p
    bad = [
        {**p.to_json(), "version": 2},
        {**p.to_json(), "roots": [0, 5]},
        {**p.to_json(), "fetch": [0, 0, 1]},
        {**p.to_json(), "orders": [[5, 0, 9], [5, 0, 9], [9, 0, 5]]},  # shard 0's tree not rooted at its root
        {**p.to_json(), "orders": [[0, 0, 9], [5, 0, 9], [9, 0, 5]]},
        {**p.to_json(), "orders": [[0, 7, 9], [5, 0, 9], [9, 0, 5]]},  # 7 is not a member
        {**p.to_json(), "fanout": 0},
        {**p.to_json(), "chunk_bytes": 1 << 30},
        {**p.to_json(), "term": "3"},
        {**p.to_json(), "extra": 1},
    ]
    for b in bad:
        with pytest.raises(ProtocolError):
            Plan.from_json(b, m, max_chunk_bytes=1 << 24)
