"""The controller elected through a real etcd (syncd.cluster.etcd_election), with cluster nodes in one process:
one controller whose term is its etcd leader key's revision, every node agreeing; a takeover with a higher term
when it stops; a controller cut off from etcd steps down before another can lead; and fencing: a plan or a
controller heartbeat of an older term than the newest a node has seen is refused."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import pytest

from bench.netsim import free_port
from syncd.cluster import ClusterConfig, ClusterSecret
from syncd.cluster.etcd import EtcdClient
from syncd.cluster.etcd_election import key_prefix
from syncd.cluster.etcd_gateway import parse_endpoints
from syncd.cluster.membership import Member
from syncd.cluster.node import ClusterNode
from tests.cluster._util import KEY, RUN, SECRET
from tests.cluster.conftest import Publisher

pytestmark = [pytest.mark.integration]

TTL = 2  # etcd's minimum lease: a dead controller is replaced within about this long


def run(coro, timeout=60):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def make_nodes(tmp_path, store, etcd, n):
    peers = {r: Member(r, "127.0.0.1", free_port()) for r in range(n)}
    return [ClusterNode(str(store), RUN, secret=ClusterSecret.parse(SECRET), cache_root=tmp_path / f"node{r}",
                        signing_key=KEY, events=tmp_path / f"node{r}.events",
                        config=ClusterConfig(rank=r, peers=peers, heartbeat_s=0.2, poll_s=0.2, fsync=False,
                                             etcd=etcd.url, etcd_ttl_s=TTL, chunk_bytes=8192))
            for r in range(n)]


@contextlib.asynccontextmanager
async def running_nodes(tmp_path, store, etcd, n):
    """:func:`make_nodes`' ``n`` nodes, started, and stopped after."""
    nodes = make_nodes(tmp_path, store, etcd, n)
    for node in nodes:
        await node.start()
    try:
        yield nodes
    finally:
        for node in nodes:
            await node.stop()


async def elected(nodes, what):
    """The agreed ``(controller, term)`` of ``nodes``, awaited (for at most 10 TTLs)."""
    return await until(lambda: agreed(nodes), 10 * TTL, what)


@pytest.fixture
def store(tmp_path):
    """The cluster's file store (an empty folder)."""
    (tmp_path / "store").mkdir()
    return tmp_path / "store"


def events(tmp_path, rank, ev):
    with open(tmp_path / f"node{rank}.events") as fh:
        return [e for e in map(json.loads, fh) if e["ev"] == ev]


async def until(pred, timeout, what):
    deadline = time.monotonic() + timeout
    while not (got := pred()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.05)
    return got


def agreed(nodes):
    """The controller every running node names, with its term, once they all agree."""
    seen = {(n.summary()["controller"], n.summary()["term"]) for n in nodes if n.running}
    if len(seen) == 1:
        ctrl, term = seen.pop()
        if ctrl is not None and any(n.rank == ctrl and n.is_controller for n in nodes):
            return ctrl, term
    return None


def test_one_controller_term_is_the_etcd_revision_and_a_takeover_raises_it(tmp_path, store, etcd):

    async def main():
        async with running_nodes(tmp_path, store, etcd, 3) as nodes:
            ctrl, term = await elected(nodes, "one controller all nodes agree on")
            client = EtcdClient(etcd.url)
            kv, _ = await client.leader(key_prefix(RUN) + b"controller")
            assert kv.create_revision == term, "the term is the leader key's creation revision"
            assert json.loads(kv.value)["rank"] == ctrl
            members = await client.range_prefix(key_prefix(RUN) + b"members/")
            assert [json.loads(kv.value)["rank"] for kv in members] == [0, 1, 2], "one leased record per node"
            assert all(n.summary()["election"] == "etcd" for n in nodes)
            old = nodes[ctrl]
            t_stop = time.monotonic()
            await old.stop()  # revokes its lease: the next candidate leads at once
            ctrl2, term2 = await elected(nodes, "a new controller")
            took = time.monotonic() - t_stop
            assert ctrl2 != ctrl and term2 > term, "a later controller has a higher term"
            assert took < 2 * TTL, f"a controller that stops hands over at once (took {took:.1f}s)"
            members = await client.range_prefix(key_prefix(RUN) + b"members/")
            assert ctrl not in [json.loads(kv.value)["rank"] for kv in members], "a stopped node leaves"
            await until(lambda: all(n.summary()["live"] == sorted({0, 1, 2} - {ctrl}) for n in nodes if n.running),
                        10 * TTL, "the stopped node out of the live set")
            for n in nodes:
                assert not n.supervisor.died(), n.supervisor.health()

    run(main())


def test_a_controller_cut_off_from_etcd_steps_down_before_another_leads(tmp_path, store, etcd):

    async def main():
        async with running_nodes(tmp_path, store, etcd, 2) as nodes:
            ctrl, term = await elected(nodes, "a controller")
            cut = nodes[ctrl].heartbeats.election
            cut.client.endpoints = parse_endpoints(f"http://127.0.0.1:{free_port()}")  # etcd unreachable from it
            other = nodes[1 - ctrl]
            await until(lambda: other.is_controller, 10 * TTL, "the other node to lead")
            assert not nodes[ctrl].is_controller
            down = events(tmp_path, ctrl, "step_down")
            took_over = [e for e in events(tmp_path, other.rank, "controller") if e["term"] > term]
            assert down and took_over and down[0]["t"] <= took_over[0]["t"], (
                "the cut-off controller stopped acting before etcd let another lead")
            assert "TTL" in down[0]["why"]
            assert other.heartbeats.election.term > term

    run(main())


def test_stale_plans_and_claims_are_refused(tmp_path, store, etcd, states):
    pub = Publisher(store, states)
    v0 = pub.next()
    pub.close()

    async def main():
        async with running_nodes(tmp_path, store, etcd, 3) as nodes:
            ctrl, term = await elected(nodes, "a controller")
            await until(lambda: all(n.delivered == v0 for n in nodes), 30, f"version {v0} everywhere")
            old_plan = nodes[ctrl].plans[v0]
            await nodes[ctrl].stop()
            ctrl2, term2 = await elected(nodes, "a new controller")
            follower = next(n for n in nodes if n.running and n.rank != ctrl2)
            assert follower.heartbeats.election.max_term == term2
            before = follower.stats["stale_refused"]
            held = follower.plans[v0].plan
            msg = {"plan": {**old_plan.plan.to_json(), "seq": held.seq + 1000},
                   "manifest": old_plan.raw.decode("ascii")}
            assert msg["plan"]["term"] == term < term2
            await follower.on_plan(ctrl, msg)  # what the old controller would send after a stall
            assert follower.stats["stale_refused"] == before + 1
            assert follower.plans[v0].plan == held, "a later seq of the old term would have replaced it unfenced"
            hb = {**nodes[ctrl].heartbeats.heartbeat(), "ctrl": ctrl, "term": term, "starts": {str(follower.rank): 0}}
            follower.heartbeats._on_heartbeat(ctrl, hb)  # its claim and commands, of the old term
            assert follower.stats["stale_refused"] == before + 2
            assert follower.summary()["controller"] == ctrl2, "a stale claim does not move the controller"
            refused = events(tmp_path, follower.rank, "stale_refused")
            assert [(e["what"], e["peer"], e["term"], e["newest"]) for e in refused[-2:]] == [
                ("plan", ctrl, term, term2), ("heartbeat", ctrl, term, term2)]
            msg["plan"]["term"] = term2
            await follower.on_plan(ctrl2, msg)  # the same plan under the current term is taken
            assert follower.plans[v0].plan.term == term2 and follower.stats["stale_refused"] == before + 2

    run(main())


def test_hostile_etcd_contents_and_replies_are_counted_not_followed(tmp_path, store, etcd):
    """A candidate and a member record in etcd not signed with the cluster secret are ignored (the forged
    candidate, oldest in the queue, holds etcd's lead: nobody follows it, nobody controls until it goes); a fake
    etcd answering garbage costs counted failures, never a task."""

    async def main():
        client = EtcdClient(etcd.url)
        forged = await client.grant(60)
        await client.campaign(key_prefix(RUN) + b"controller", forged.id, b'{"rank": 0, "inc": "x", "mac": "00"}')
        await client.put(key_prefix(RUN) + b"members/000007", b'{"rank": 7, "host": "10.6.6.6", "port": 1}',
                         lease=forged.id)
        async with running_nodes(tmp_path, store, etcd, 2) as nodes:
            await until(lambda: all(n.summary()["live"] == [0, 1] for n in nodes), 10 * TTL, "both nodes live")
            await asyncio.sleep(2 * TTL)
            assert not any(n.is_controller for n in nodes) and all(n.summary()["controller"] is None for n in nodes)
            assert all(7 not in n.summary()["members"] for n in nodes), "an unsigned member record is ignored"
            await client.revoke(forged.id)
            await elected(nodes, "a controller once the forged candidate is gone")
            for n in nodes:
                assert not n.supervisor.died(), n.supervisor.health()

    async def garbage():
        from tests.cluster.test_etcd_client import FakeEtcd, http

        async with FakeEtcd(http(b'{"ID": "1", "TTL": 1.5, "kvs": "x"}')) as fake:
            (tmp_path / "fake").mkdir()
            async with running_nodes(tmp_path / "fake", store, fake, 2) as nodes:
                await until(lambda: all(n.stats["failures"].get("etcd", 0) >= 3 for n in nodes), 10 * TTL,
                            "failed etcd calls counted")
                assert not any(n.is_controller for n in nodes)
                for n in nodes:
                    assert not n.supervisor.died(), n.supervisor.health()
                    assert events(tmp_path / "fake", n.rank, "etcd_error")

    run(main())
    run(garbage())
