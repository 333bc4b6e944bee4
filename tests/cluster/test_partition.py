"""A network partition with the controller elected through etcd: the store, etcd and five node daemons, each with
its reference-engine process, each node in its own network namespace (bench.cluster_failover.NetLab). Once a
version is everywhere, the controller and one other node are cut off from etcd and the other three while a version
is published (blackhole routes both ways: packets vanish; the store stays reachable from both sides); two more are
published during the partition; the link is healed and one more is published. A watcher outside the partition
samples every engine's version and weight checksums the whole time.

The minority side never acts as controller: its controller steps down within its lease, nobody there takes over,
and it distributes nothing on its own; the majority elects a controller of a newer term. After healing every node
converges on the newest version, in order and bit-exact. The store's own log shows every shard of every version
read at most once (the version in flight at the cut: at most once per root its plans had). Every byte a node ever
delivered is the manifest's: each cached shard file hashes to its name; and no engine ever held a wrong byte:
every watcher sample that no weight write overlapped has exactly the checksums of the version the engine reports
(or the model folder's, before its first version), and every engine ends on the newest version. Skipped only where
network namespaces cannot be made (CI runs as root: it runs there)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from bench import netsim as sim
from bench.cluster_failover import NetLab, controllers, partition_run
from bench.netsim import watch
from syncd.ops import checksum
from syncd.versions import read_manifest
from tests.cluster._util import (KEY, RUN, SECRET, assert_in_order, assert_no_task_errors,
                                 assert_store_reads_by_roots, weights_from_cache)
from tests.cluster.conftest import Publisher
from tests.store._models import assert_same

pytestmark = [pytest.mark.integration, pytest.mark.slow]

WHY = sim.netns_available()
TTL = 2  # seconds: etcd's minimum lease
WAIT = 15 * TTL


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A reference-engine model folder and the bf16 weights of its model after each of 5 real AdamW steps."""
    from syncd.engine.reference.make_tiny import model_config, random_model, write_model
    from tests.store._models import bf16, train_steps

    folder = write_model(tmp_path_factory.mktemp("model") / "tiny")
    model = random_model(model_config(), 0)  # what write_model saved
    states = [bf16(model.state_dict())]
    train_steps(model, 5, callback=lambda _s, m: states.append(bf16(m.state_dict())))
    return folder, states


@pytest.mark.skipif(WHY is not None, reason=f"a partition needs network namespaces (root and iproute2): {WHY}")
def test_partition_minority_never_controls_and_every_node_converges(tmp_path, served):
    model, states = served
    store = tmp_path / "store"
    store.mkdir()
    pub = Publisher(store, states)
    n = 5
    try:
        # dead after 3 s, not 3 heartbeats: on a starved machine a controller that missed its peers' heartbeats
        # would root every shard itself (a cut-off node leaves the live set with its lease anyway)
        with NetLab(tmp_path / "lab", store, n, run_id=RUN, signing_key=KEY, secret=SECRET, heartbeat_s=0.25,
                    ttl_s=TTL, args=["--dead-after-s", "3"], engines=model) as lab:
            res = partition_run(lab, pub.next, wait_s=WAIT)
            newest = res["after"][-1]
            lab.nodes.wait(lambda: {s.get("version") for s in watch.read(lab.watch_log)[-2 * n:]} == {newest},
                           WAIT, f"every engine to report version {newest}")
            reads = lab.store_reads()
            c = lab.nodes
    finally:
        pub.close()
    samples = watch.read(lab.watch_log)
    minority, majority, t_cut, t_heal = res["minority"], res["majority"], res["t_cut"], res["t_heal"]
    versions = res["before"] + res["window"] + res["during"] + res["after"]
    ctrl_before = controllers(c, range(n))
    old = [x for x in ctrl_before if x[0] < t_cut][-1]
    assert old[1] in minority, "the scenario cuts the controller off"

    # the minority side never acts as controller
    assert not [x for x in controllers(c, minority) if t_cut < x[0] < t_heal], "nobody on the minority side took over"
    down = [e for e in c.events(old[1], "step_down") if t_cut < e["t"] < t_heal]
    assert down and down[0]["term"] == old[2], "the cut-off controller stepped down during the partition"
    for r in minority:
        late = [e for e in c.events(r, "plan") if e["sender"] in minority and e["t"] > t_cut + TTL + 1]
        assert not late, f"node {r} took a plan from its own side after the controller's lease ran out: {late}"
        early = [e for e in c.events(r, "delivered") if e["v"] in res["during"] and e["t"] < t_heal]
        assert not early, f"node {r} got a version of the partition without a controller: {early}"
    new = [x for x in controllers(c, majority) if t_cut < x[0] < t_heal]
    assert new and new[0][2] > old[2], "the majority side elected a controller of a newer term"
    for r in range(n):
        refused = c.events(r, "stale_refused")
        assert all(e["term"] < e["newest"] for e in refused)

    # after healing every node converges on the newest version, in order, bit-exact
    for r in range(n):
        assert_in_order(c, r)
        assert c.delivered(r)[-1] == newest
        assert_same(weights_from_cache(c.cache(r), store, newest), states[newest])
    assert_no_task_errors(c, range(n))

    # no wrong byte at any time: what each node delivered is the manifest's, and its cache holds only verified files
    for r in range(n):
        for e in c.events(r, "delivered"):
            assert e["shas"] == [s.sha256 for s in read_manifest(store, RUN, e["v"], signing_key=KEY).shards]
        for f in Path(c.cache(r), "shards").iterdir():
            assert hashlib.sha256(f.read_bytes()).hexdigest() == f.name, f"node {r}: {f.name} is not what it says"

    # no engine ever held a wrong byte: every clean sample has its version's checksums, and all end on the newest
    sums = {v: {t.name: t.checksum for t in read_manifest(store, RUN, v, signing_key=KEY).tensors} for v in versions}
    initial = {k: checksum(t) for k, t in states[0].items()}  # the model folder's, before the first version
    clean = [x for x in samples if "error" not in x and x["clean"]]
    for x in clean:
        want = initial if x["version"] is None else sums[x["version"]]
        assert x["checksums"] == want, f"engine {x['engine']} at version {x['version']} holds other weights"
    for r in range(n):
        seen = [x for x in clean if x["engine"] == f"e{r}"]
        assert seen and seen[-1]["version"] == newest, f"engine {r} ends on version {newest}"
        during = [x for x in seen if t_cut < x["t"] < t_heal]
        assert during, f"engine {r} was sampled during the partition"

    # store reads, counted at the store
    assert_store_reads_by_roots(c, reads, store, newest + 1, range(n))
    for v in res["before"] + res["during"] + res["after"]:
        for s in read_manifest(store, RUN, v, signing_key=KEY).shards:
            got = sum(e["bytes"] for e in reads if e["key"] == f"runs/{RUN}/{s.key}")
            assert got <= s.size, f"version {v}: a shard read {got / s.size:.2f} times"
            if v in res["after"]:
                assert got == s.size, f"version {v} after the partition: every shard crosses the link once"
