"""A cluster on a real (simulated) network: every node and the store in its own network namespace, the
store behind a slow ``tc tbf`` link, the nodes on faster ones. A relay is killed mid-broadcast, then the
controller; a node restarts. Every node ends on the newest version, bit-exact, and the store -- counted
at the store -- served each shard once per root it had: exactly once unless its root died (a root killed
right after the store sent it a shard takes those bytes with it; the next root reads the shard again), and
only ever to a root. No task of any node died."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from bench import netsim as sim
from tests.cluster._util import (KEY, RUN, SECRET, assert_in_order, assert_no_task_errors, assert_store_reads_by_roots,
                                 segments, store_log_reads, version_bytes, weights_from_cache)
from tests.cluster.conftest import Publisher
from tests.store._models import assert_same

pytestmark = [pytest.mark.integration, pytest.mark.slow]

WHY = sim.netns_available()


@pytest.mark.skipif(WHY is not None, reason=f"needs network namespaces: {WHY}")
def test_shaped_network_relay_and_controller_die_node_restarts(tmp_path, states):
    store = tmp_path / "store"
    store.mkdir()
    hosts = ["st", "n0", "n1", "n2", "n3"]
    with sim.Netns(hosts) as net:
        net.shape("st", 1e6)  # the long link: 1 Mbit/s
        for h in hosts[1:]:
            net.shape(h, 4e6)  # inside the cluster: 4 Mbit/s each
        log = tmp_path / "store.log"
        ready = tmp_path / "store.port"
        srv = subprocess.Popen([*net.exec_prefix("st"), sys.executable, "-m", "bench.netsim", "s3serve",
                                str(store), "--host", net.ip("st"), "--port", "8080", "--log", str(log),
                                "--ready", str(ready)])
        c = sim.NodeProcs(tmp_path / "nodes", store="s3://simstore", run_id=RUN, secret=SECRET, signing_key=KEY,
                          addrs={r: (net.ip(f"n{r}"), 7400) for r in range(4)},
                          prefix={r: net.exec_prefix(f"n{r}") for r in range(4)},
                          env={**sim.s3_env(), "AWS_ENDPOINT_URL": f"http://{net.ip('st')}:8080"},
                          args=["--heartbeat-s", "0.25", "--poll-s", "0.2", "--no-fsync", "--chunk-bytes", "8192",
                                "--stall-s", "2"])
        try:
            c.wait(lambda: ready.exists(), 10, "the store's S3 endpoint")
            pub = Publisher(store, states, shard_bytes=32 << 10)
            c.start_all()
            c.wait(lambda: all(any(e["ev"] == "live" and len(e["live"]) == 4 for e in c.events(r)) for r in range(4)),
                   20, "all four nodes see each other")
            v0 = pub.next()
            # kill -9 a relay (not the controller) as soon as a child receives from it
            c.wait(lambda: any(e["src"] in (2, 3) for r in range(4) for e in c.events(r, "pulling")), 20,
                   "a pull from rank 2 or 3")
            relay = next(e["src"] for r in range(4) for e in c.events(r, "pulling") if e["src"] in (2, 3))
            c.kill(relay)
            alive = [r for r in range(4) if r != relay]
            c.wait(lambda: all(v0 in c.delivered(r) for r in alive), 60, "version 0 on the survivors")
            # the controller dies while the next versions are distributed
            for _ in range(3):
                last = pub.next()  # 1, 2 (deltas), 3 (full)
            c.wait(lambda: any(e["v"] == last for e in c.events(1, "plan")), 20, f"plan of version {last}")
            c.kill(0)
            alive.remove(0)
            c.wait(lambda: all(last in c.delivered(r) for r in alive), 60, f"version {last} on the survivors")
            assert any(e["term"] >= 2 for r in alive for e in c.events(r, "controller")), "a new controller"
            # the relay comes back and catches up from its peers
            c.start(relay)
            alive.append(relay)
            v4 = pub.next()
            pub.close()
            c.wait(lambda: all(v4 in c.delivered(r) for r in alive), 60, f"version {v4} on every live node")
            for r in alive:
                assert_in_order(c, r)
                assert_same(weights_from_cache(c.cache(r), store, v4), states[v4])
            assert segments(c, relay)[-1][-1] == v4
            assert_no_task_errors(c, range(4))
            # what the store served, counted at the store, per shard: exactly once while a shard's root lived,
            # once more for each root that took over from one that died (or was too slow), never by a node
            # that was not the shard's root
            reads = store_log_reads(sim.read_store_log(log), {net.ip(f"n{r}"): r for r in range(4)})
            assert_store_reads_by_roots(c, reads, store, v4 + 1, range(4))
            served = [sum(e["bytes"] for e in reads if f"/versions/{v:012d}/" in e["key"]) for v in range(v4 + 1)]
            print("store bytes / version bytes:", [round(n / version_bytes(store, v), 3) for v, n in enumerate(served)])
            assert all(n >= version_bytes(store, v) for v, n in enumerate(served)), "every shard crossed the link"
            assert served[v4] == version_bytes(store, v4), "after the failures, every byte crosses the link once"
        finally:
            c.stop_all()
            srv.send_signal(signal.SIGTERM)
