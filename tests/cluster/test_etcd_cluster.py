"""Cluster node processes elected through a real etcd: the etcd server killed (SIGKILL) and restarted mid-run, and a
controller stalled (SIGSTOP) until its lease expires, replaced, then resumed (SIGCONT). Every node ends on the newest
version, bit-exact and in order; nobody controls while etcd is down; the stalled controller's old term is refused and
it steps down; no task of any node fails. Timeouts are derived from the lease TTL."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from syncd import manifest as mf
from syncd.cluster import auth, wire
from syncd.cluster.auth import ClusterSecret
from syncd.cluster.planner import plan_version
from syncd.cluster.wire import T
from syncd.store import Store
from syncd.versions import read_manifest
from tests.cluster._util import (KEY, RUN, SECRET, assert_in_order, assert_no_task_errors,
                                 assert_store_reads_by_roots, event_reads, version_bytes, weights_from_cache)
from tests.cluster.conftest import Publisher
from tests.store._models import assert_same

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TTL = 2  # seconds: etcd's minimum lease
WAIT = 15 * TTL  # the bound of any one wait: generous on a busy machine, still CI-sized


def controllers(c, ranks) -> list[tuple[float, int, int]]:
    """``(time, rank, term)`` of every takeover, in time order."""
    return sorted((e["t"], r, e["term"]) for r in ranks for e in c.events(r, "controller"))


def started(c, n):
    c.start_all()
    c.wait(lambda: all(any(e["ev"] == "live" and len(e["live"]) == n for e in c.events(r)) for r in range(n)),
           WAIT, f"all {n} nodes see each other")
    return c.wait(lambda: controllers(c, range(n)), WAIT, "a controller")


def test_etcd_killed_and_restarted_mid_run(tmp_path, states, make_cluster, etcd):
    store = tmp_path / "store"
    store.mkdir()
    n = 4
    # dead after 3 s, not 3 heartbeats: on a starved machine a controller that missed its peers' heartbeats would
    # root every shard itself, and the exactly-once reads below would not hold
    c = make_cluster(n, store, "--etcd", etcd.url, "--etcd-ttl-s", str(TTL), "--dead-after-s", "3")
    pub = Publisher(store, states)
    started(c, n)
    v0 = pub.next()
    c.wait(lambda: all(v0 in c.delivered(r) for r in range(n)), WAIT, f"version {v0} everywhere")
    v1 = pub.next()
    t_kill = time.time()
    etcd.kill()  # SIGKILL while version 1 is being distributed
    down = c.wait(lambda: [e for r in range(n) for e in c.events(r, "step_down") if e["t"] > t_kill], WAIT,
                  "the controller to step down once its lease may have expired")
    assert "etcd unreachable" in down[0]["why"]
    v2 = pub.next()  # published while etcd is down
    t_back = time.time()  # from here etcd may answer: a node can win before start() has seen it healthy
    etcd.start()
    v3 = pub.next()
    pub.close()
    c.wait(lambda: all(v3 in c.delivered(r) for r in range(n)), WAIT, f"version {v3} everywhere after the restart")
    takeovers = controllers(c, range(n))
    assert not [t for t, _, _ in takeovers if t_kill < t < t_back], "nobody took over while etcd was down"
    assert takeovers[-1][2] > takeovers[0][2], "the controller after the restart has a newer term"
    assert any(e["call"] for r in range(n) for e in c.events(r, "etcd_error")), "the outage was seen"
    for r in range(n):
        assert_in_order(c, r)
        assert c.delivered(r)[-4:] == [v0, v1, v2, v3]
        assert_same(weights_from_cache(c.cache(r), store, v3), states[v3])
    assert_no_task_errors(c, range(n))
    assert_store_reads_by_roots(c, event_reads(c, range(n), store, v3 + 1), store, v3 + 1, range(n))
    reads = {v: sum(e["bytes"] for r in range(n) for e in c.events(r, "store_read") if e["v"] == v)
             for v in (v0, v3)}
    assert reads == {v0: version_bytes(store, v0), v3: version_bytes(store, v3)}, "away from the outage: once"


async def send_plan_as(addr, rank: int, payload: bytes) -> None:
    """Send one PLAN frame to the node at ``addr`` over an authenticated control connection, as member ``rank``
    (what a resumed controller would send; every member holds the cluster secret)."""
    ch = await auth.connect(addr[0], addr[1], ClusterSecret.parse(SECRET), rank=rank, role="control", timeout=5)
    try:
        await ch.send(T.PLAN, payload)
        await asyncio.sleep(0.2)
    finally:
        ch.close()


def test_a_stalled_controller_is_replaced_and_its_old_term_refused(tmp_path, states, make_cluster, etcd):
    store = tmp_path / "store"
    store.mkdir()
    n = 4
    c = make_cluster(n, store, "--etcd", etcd.url, "--etcd-ttl-s", str(TTL))
    pub = Publisher(store, states)
    started(c, n)
    v0 = pub.next()
    c.wait(lambda: all(v0 in c.delivered(r) for r in range(n)), WAIT, f"version {v0} everywhere")
    _, old, old_term = controllers(c, range(n))[-1]
    others = [r for r in range(n) if r != old]
    t_stop = time.time()
    c.procs[old].send_signal(signal.SIGSTOP)
    try:
        _, new, new_term = c.wait(lambda: [x for x in controllers(c, others) if x[2] > old_term], WAIT,
                                  "another node to take over")[0]
        v1 = pub.next()
        c.wait(lambda: all(v1 in c.delivered(r) for r in others), WAIT, f"version {v1} on the others")
        c.wait(lambda: all(any(e["term"] == new_term for e in c.events(r, "plan")) for r in others), WAIT,
               "every other node to hold a plan of the new term")
        # a plan the stalled controller had built under its old term, arriving now: a later seq of version 1
        m = read_manifest(store, RUN, v1, signing_key=KEY)
        raw = Store.open(str(store)).get(mf.manifest_key(RUN, v1))
        stale = plan_version(m, live=range(n), needers=set(range(n)), fanout=2, chunk_bytes=8192, term=old_term,
                             seq=10 ** 6)
        payload = wire.dump_json({"plan": stale.to_json(), "manifest": raw.decode("ascii")})
        for r in others:
            asyncio.run(send_plan_as(c.addrs[r], old, payload))
        c.wait(lambda: all(any(e["what"] == "plan" and e["term"] == old_term for e in c.events(r, "stale_refused"))
                           for r in others), WAIT, "every other node to refuse the old term's plan")
    finally:
        c.procs[old].send_signal(signal.SIGCONT)
    down = c.wait(lambda: [e for e in c.events(old, "step_down") if e["t"] > t_stop], WAIT,
                  "the resumed controller to step down")
    assert down[0]["term"] == old_term
    v2 = pub.next()
    pub.close()
    c.wait(lambda: all(v2 in c.delivered(r) for r in range(n)), WAIT, f"version {v2} everywhere")
    # fencing, as every node saw it: once a node held a plan of the new term, it took none of an older one
    for r in others:
        plans = c.events(r, "plan")
        first_new = next(i for i, e in enumerate(plans) if e["term"] >= new_term)
        assert all(e["term"] >= new_term for e in plans[first_new:]), f"node {r} took a stale plan: {plans}"
    refused = [e for r in others for e in c.events(r, "stale_refused")]
    assert all(e["peer"] == old and e["term"] == old_term and e["newest"] >= new_term for e in refused)
    assert not [x for x in controllers(c, [old]) if x[0] > down[0]["t"] and x[2] <= new_term], (
        "the resumed node never controls an old term again")
    for r in range(n):
        assert_in_order(c, r)
        assert_same(weights_from_cache(c.cache(r), store, v2), states[v2])
    assert_no_task_errors(c, range(n))
