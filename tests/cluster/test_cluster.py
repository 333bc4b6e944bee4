"""Clusters of real node processes on loopback: every node ends on every version, in order, verified, with
each shard read from the store once; relays, the controller and nodes die and come back."""

from __future__ import annotations

import asyncio

import pytest

from syncd.cluster import auth
from syncd.cluster.auth import ClusterSecret
from syncd.cluster.errors import AuthError
from tests.cluster._util import (assert_checksums_equal, assert_in_order, assert_no_task_errors,
                                 assert_store_reads_by_roots, event_reads, segments, store_reads, version_bytes,
                                 weights_from_cache)
from tests.cluster.conftest import Publisher
from tests.store._models import assert_same

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_every_node_gets_every_version_once_from_the_store(tmp_path, states, make_cluster):
    store = tmp_path / "store"
    pub = Publisher(store, states)
    pub.next(), pub.next()  # versions 0 (full) and 1 (delta) exist before the cluster starts
    # members from the store directory; a node is dead after 3 s without a heartbeat (not 0.75 s): no stall of a
    # starved machine moves a root, so each shard is read exactly once
    c = make_cluster(4, store, "--discover-s", "0.3", "--dead-after-s", "3", discovery="simcl")
    c.start_all()
    c.wait(lambda: all(1 in c.delivered(r) for r in range(4)), 40, "version 1 on every node")
    for _ in range(3):
        pub.next()  # versions 2, 3 (full), 4 while the cluster runs
    pub.close()
    c.wait(lambda: all(4 in c.delivered(r) for r in range(4)), 40, "version 4 on every node")
    for r in range(4):
        assert c.delivered(r) == [0, 1, 2, 3, 4], f"node {r}: order, no skip, no repeat"
        assert_same(weights_from_cache(c.cache(r), store, 4), states[4])
    assert_checksums_equal(weights_from_cache(c.cache(2), store, 2), states[2])
    reads = store_reads(c, range(4))
    for v in range(5):
        assert reads[v] == version_bytes(store, v), f"version {v}: each shard read from the store exactly once"
    roots = {r for r in range(4) if any(e["bytes"] for e in c.events(r, "store_read"))}
    assert len(roots) >= 3, "the store reads are spread over the nodes"
    assert_no_task_errors(c, range(4))
    # Rank 0 controls in the end. A higher rank may have held the role before it heard rank 0 (members are
    # found through the store, and on a loaded machine a process can start seconds late), and two nodes that
    # claim at once can open the same term; rank 0 then claims again, so the highest term is rank 0's alone
    # and its plans win. The store reads above show nothing was fetched twice.
    takeovers = sorted((e["term"], r) for r in range(4) for e in c.events(r, "controller"))
    assert takeovers, "nobody took over"
    top = takeovers[-1][0]
    assert [r for t, r in takeovers if t == top] == [0], f"the highest term is rank 0's alone: {takeovers}"

    # strangers are refused and counted: a wrong secret, and bytes that are not the protocol
    async def strangers():
        host, port = c.addrs[2]
        with pytest.raises(AuthError):
            await auth.connect(host, port, ClusterSecret(b"not-the-cluster-secret!!"), rank=9, role="data")
        r, w = await asyncio.open_connection(host, port)
        w.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await w.drain()
        assert await r.read() == b""  # closed without an answer
        w.close()

    asyncio.run(strangers())
    refused = c.wait(lambda: len(c.events(2, "refused")) >= 2 and c.events(2, "refused"), 5, "refusals logged")
    assert any("AuthError" in e["why"] for e in refused) and any("ProtocolError" in e["why"] for e in refused)


def test_relay_killed_controller_killed_node_restarted(tmp_path, states, make_cluster):
    store = tmp_path / "store"
    pub = Publisher(store, states, shard_bytes=32 << 10)
    c = make_cluster(5, store, "--throttle-bps", "150000", "--chunk-bytes", "4096")
    c.extra[4] = ["--throttle-bps", "40000"]  # the relay we kill sends slowly: its children are mid-shard
    c.start_all()
    c.wait(lambda: all(any(e["ev"] == "live" and len(e["live"]) == 5 for e in c.events(r)) for r in range(5)),
           20, "all five nodes see each other")
    v0 = pub.next()
    # kill -9 the relay as soon as a child has received a chunk from it
    c.wait(lambda: any(e["src"] == 4 for r in range(4) for e in c.events(r, "pulling")), 20, "a pull from rank 4")
    c.kill(4)
    c.wait(lambda: all(v0 in c.delivered(r) for r in range(4)), 40, "version 0 on the survivors")
    switches = [e for r in range(4) for e in c.events(r, "switch") if e["src"] == 4 and "Error" in e["why"]]
    assert switches, "some child of the dead relay moved to another source"
    assert any(e["have"] > 0 for e in switches), "and resumed at the chunk where it stopped"
    # kill the controller while the next full version is being planned and distributed
    for _ in range(3):
        last = pub.next()  # 1, 2 (deltas), 3 (full)
    c.wait(lambda: any(e["v"] == last for e in c.events(1, "plan")), 20, f"plan of version {last}")
    c.kill(0)
    c.wait(lambda: any(e["term"] >= 2 for e in c.events(1, "controller")), 20, "rank 1 takes over")
    c.wait(lambda: all(last in c.delivered(r) for r in (1, 2, 3)), 40, f"version {last} on the survivors")
    # the relay comes back: it catches up from its peers, not from the store
    c.start(4)
    v4 = pub.next()
    pub.close()
    c.wait(lambda: all(v4 in c.delivered(r) for r in (1, 2, 3, 4)), 40, f"version {v4} everywhere")
    for r in (1, 2, 3, 4):
        assert_in_order(c, r)
        assert_same(weights_from_cache(c.cache(r), store, v4), states[v4])
    for r in (1, 2, 3):
        assert c.delivered(r) == list(range(0, v4 + 1)), f"node {r} skipped or repeated a version"
    back = segments(c, 4)[-1]
    assert back[-1] == v4 and back[0] <= last
    caught_up = [e for e in c.events(4, "store_read") if e["v"] < v4 and e["t"] > c.events(4, "start")[-1]["t"]]
    assert sum(e["bytes"] for e in caught_up) == 0, "the restarted node caught up from its peers"
    # each shard read once per root it had (a killed root's read is read again by the next), only by roots
    assert_store_reads_by_roots(c, event_reads(c, range(5), store, v4 + 1), store, v4 + 1, range(5))
    assert_no_task_errors(c, range(5))


def test_a_slow_node_is_moved_to_the_leaves_and_does_not_hold_back_the_others(tmp_path, states, make_cluster):
    store = tmp_path / "store"
    pub = Publisher(store, states, full_every=1)
    c = make_cluster(5, store, "--throttle-bps", "400000")
    c.extra[2] = ["--throttle-bps", "15000"]  # rank 2 uploads at 15 kB/s, everyone else at 400 kB/s
    c.start_all()
    c.wait(lambda: all(any(e["ev"] == "live" and len(e["live"]) == 5 for e in c.events(r)) for r in range(5)),
           20, "all five nodes see each other")
    for _ in range(2):
        v = pub.next()
        c.wait(lambda: all(v in c.delivered(r) for r in range(5)), 60, f"version {v} everywhere")
    plans = [e for e in c.events(0, "plan")]
    marked = [e for e in plans if 2 in e["slow"]]
    assert marked, "the controller marked rank 2 slow from its children's reports"
    assert all(2 not in e["relays"] for e in marked), "and moved it to the leaves of every tree"
    # once it is known slow, a new version reaches everyone else as fast as if it were not there
    v = pub.next()
    pub.close()
    c.wait(lambda: all(v in c.delivered(r) for r in range(5)), 60, f"version {v} everywhere")
    plan_t = min(e["t"] for e in plans + c.events(0, "plan") if e["v"] == v)
    done = {r: next(e["t"] for e in c.events(r, "delivered") if e["v"] == v) - plan_t for r in range(5)}
    others = max(t for r, t in done.items() if r != 2)
    alone = version_bytes(store, v) / 15000  # what rank 2 would need to upload the version once
    assert others < alone / 4, f"the others finished in {others:.2f}s; rank 2 alone would take {alone:.1f}s"
    for r in range(5):
        assert c.delivered(r) == [0, 1, 2]
    assert_no_task_errors(c, range(5))


def test_a_node_whose_state_file_cannot_be_written_keeps_delivering(tmp_path, states, make_cluster):
    store = tmp_path / "store"
    pub = Publisher(store, states)
    c = make_cluster(2, store)
    c.start_all()
    v0 = pub.next()
    c.wait(lambda: all(v0 in c.delivered(r) for r in range(2)), 40, "version 0 on both nodes")
    blocker = c.cache(1) / "cluster" / "state.json.tmp"
    blocker.mkdir()  # the state file can no longer be replaced (as on a full or read-only disk)
    for _ in range(2):
        v = pub.next()
    c.wait(lambda: all(v in c.delivered(r) for r in range(2)), 40, f"version {v} on both nodes")
    assert [e["v"] for e in c.events(1, "state_error")][:2] == [1, 2], "each failed write reported"
    blocker.rmdir()
    v = pub.next()
    pub.close()
    c.wait(lambda: all(v in c.delivered(r) for r in range(2)), 40, f"version {v} on both nodes")
    c.wait(lambda: '"delivered": 3' in (c.cache(1) / "cluster" / "state.json").read_text(), 10, "the state file")
    assert c.delivered(1) == [0, 1, 2, 3]
    assert_no_task_errors(c, range(2))
