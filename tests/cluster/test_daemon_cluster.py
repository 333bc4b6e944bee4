"""Node daemons in cluster mode (``syncd --cluster-rank R --cluster-peers ...``): the cluster layer gets each
version's shards onto every node once and hands the versions, in order, to the daemon, which applies them
to its engines.

* the command line: ``--cluster-*`` flags over ``SYNCD_CLUSTER_*`` variables, and configuration errors that
  say what is wrong;
* two daemons with in-process engines in one event loop (the wiring, metrics and status, quickly);
* the issue's end-to-end case with real processes on loopback: four daemons, each with a reference-engine
  process, a trainer process taking real AdamW steps and publishing with ``syncd.trainer.WeightPublisher`` to a
  file store that is served as S3 (``bench.netsim``) so that every byte the store sends is counted;
  a relay is killed -9 mid-broadcast, then the controller, and both come back: every engine ends on the
  newest version with the trainer's checksums, and the store served each shard about once.
"""

from __future__ import annotations

import asyncio
import io
import json
import signal
import time
import urllib.request

import pytest

from syncd import engine
from syncd.app import cli, commands
from syncd.cluster import ClusterConfig, ClusterSecret, auth
from syncd.cluster.errors import AuthError
from syncd.cluster.membership import Member
from bench.netsim import free_port, read_store_log, s3_env
from syncd.daemon import DaemonConfig, NodeDaemon
from syncd.daemon.cluster import ClusterLink, ClusterSettings, cluster_settings
from syncd.store import Store
from syncd.versions import read_manifest
from tests.cluster._util import SECRET
from tests.daemon._procs import engine_checksums, engine_version, kill9, open_gates, trainer_record, wait_until
from tests.daemon.conftest import KEY, RUN, Published
from tests.store._models import assert_same

# --------------------------------------------------------------------------------------------- command line

ENGINE = ["--run-id", "r", "--engine", "http://127.0.0.1:1"]


def settings(argv, monkeypatch, env=None):
    for k in ("SYNCD_CLUSTER_RANK", "SYNCD_CLUSTER_PEERS", "SYNCD_CLUSTER_SECRET", "SYNCD_CLUSTER_SECRET_FILE",
              "SYNCD_CLUSTER_PEERS_FROM_STORE", "SYNCD_CLUSTER_HEARTBEAT_S", "SYNCD_CLUSTER_NO_FSYNC"):
        monkeypatch.delenv(k, raising=False)
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    return cluster_settings(cli._resolve(cli.build_parser().parse_args(argv)))


def test_cluster_flags_override_environment(monkeypatch, tmp_path):
    env = {"SYNCD_CLUSTER_RANK": "1", "SYNCD_CLUSTER_PEERS": "0=127.0.0.1:7400,1=127.0.0.1:7401",
           "SYNCD_CLUSTER_HEARTBEAT_S": "2", "SYNCD_CLUSTER_SECRET": SECRET}
    s = settings(ENGINE, monkeypatch, env)
    assert s.config.rank == 1 and s.config.heartbeat_s == 2.0 and s.config.dead_after_s == 6.0
    assert s.config.peers[0] == Member(0, "127.0.0.1", 7400) and s.config.fsync
    assert s.secret.key_id == ClusterSecret.parse(SECRET).key_id
    secret_file = tmp_path / "secret"
    secret_file.write_text("another-cluster-secret-of-32-bytes!!\n")
    s = settings(["daemon", *ENGINE, "--cluster-rank", "0", "--cluster-heartbeat-s", "0.5", "--cluster-no-fsync",
                  "--cluster-secret-file", str(secret_file)], monkeypatch, env)
    assert s.config.rank == 0 and s.config.heartbeat_s == 0.5 and not s.config.fsync
    assert s.secret.key_id == ClusterSecret.parse("another-cluster-secret-of-32-bytes!!").key_id
    assert settings(ENGINE, monkeypatch) is None, "no rank anywhere: not in cluster mode"


@pytest.mark.parametrize("argv, env, message", [
    (["--cluster-peers", "0=127.0.0.1:7400"], {}, "no rank"),
    (["--cluster-rank", "0"], {}, "needs the members"),
    (["--cluster-rank", "5", "--cluster-peers", "0=127.0.0.1:7400"], {}, "not in --cluster-peers"),
    (["--cluster-rank", "0", "--cluster-peers", "0=127.0.0.1:7400"], {"SYNCD_CLUSTER_SECRET": ""}, "cluster secret"),
    (["--cluster-rank", "0", "--cluster-peers", "0=127.0.0.1"], {}, "cluster settings"),
    (["--cluster-rank", "0", "--cluster-peers", "0=127.0.0.1:7400"], {"SYNCD_CLUSTER_HEARTBEAT_S": "soon"},
     "SYNCD_CLUSTER_"),
])
def test_cluster_configuration_errors_exit_2(argv, env, message, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("SYNCD_CLUSTER_SECRET", SECRET)
    for k in ("SYNCD_CLUSTER_RANK", "SYNCD_CLUSTER_PEERS", "SYNCD_CLUSTER_SECRET_FILE", "SYNCD_ENGINES"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert cli.main(ENGINE + argv + ["--store", str(tmp_path / "s"), "--cache-dir", str(tmp_path / "c")]) == 2
    assert message in capsys.readouterr().err


# --------------------------------------------------------------------------------------------- in one loop


@pytest.mark.integration
def test_two_daemons_in_one_loop_follow_the_cluster(tmp_path):
    published = Published(tmp_path / "store")
    try:
        published.publish(2)  # 0F 1 exist before the daemons start
        peers = {r: Member(r, "127.0.0.1", free_port()) for r in range(2)}
        engines, daemons, links = [], [], []
        for r in range(2):
            engines.append(engine.StateDictEngine(published.zeros(), None))
            cfg = DaemonConfig(run_id=RUN, cache_dir=tmp_path / f"cache{r}", engine_check_s=0.1)
            d = NodeDaemon(cfg, adapters={f"e{r}": engines[r]}, store=published.store, signing_key=KEY, poll=False)
            node_cfg = ClusterConfig(rank=r, peers=peers, heartbeat_s=0.2, dead_after_s=1.0, poll_s=0.1,
                                     fsync=False, chunk_bytes=4096)
            links.append(ClusterLink(d, ClusterSettings(node_cfg, ClusterSecret.parse(SECRET)), store=published.store))
            d.attach(links[-1])
            daemons.append(d)

        async def main():
            tasks = [asyncio.ensure_future(d.run()) for d in daemons]
            try:
                await wait_until(lambda: all(e.version == 1 for e in engines), "version 1 on both engines")
                await asyncio.to_thread(published.publish, 3)  # 2, 3F, 4
                await wait_until(lambda: all(e.version == 4 for e in engines), "version 4 on both engines")
                for d in daemons:
                    d._write_status(force=True)
                return [d.metrics.render().decode() for d in daemons]
            finally:
                for d in daemons:
                    d.request_stop()
                await asyncio.wait_for(asyncio.gather(*tasks), 30)

        texts = asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        published.close()
    for e in engines:
        assert_same(e.state_dict(), published.states[4])
    total = sum(read_manifest(published.store, RUN, v, signing_key=KEY).total_bytes for v in range(5))
    assert sum(link.node.stats["store_bytes"] for link in links) == total, "each shard read from the store once"
    assert all(d.source.fetched_bytes == 0 for d in daemons), "the daemons found every shard in the cache"
    for m in peers.values():  # stopping a daemon stopped its cluster node
        with pytest.raises(ConnectionRefusedError):
            asyncio.run(asyncio.open_connection(m.host, m.port))
    peers_bytes = [metric(t, 'syncd_cluster_received_bytes_total{source="peers"}') for t in texts]
    store_bytes = [metric(t, 'syncd_cluster_received_bytes_total{source="store"}') for t in texts]
    assert sum(store_bytes) == total and all(b > 0 for b in peers_bytes), (peers_bytes, store_bytes)
    assert [metric(t, "syncd_cluster_delivered_version") for t in texts] == [4.0, 4.0]
    assert sorted(metric(t, "syncd_cluster_is_controller") for t in texts) == [0.0, 1.0]
    for r, d in enumerate(daemons):
        doc = json.loads(d.status.path.read_text())
        assert doc["cluster"]["rank"] == r and doc["cluster"]["delivered"] == 4 and doc["state"] == "stopped"


def metric(text: str, prefix: str) -> float:
    for line in text.splitlines():
        if line.startswith(prefix + " "):
            return float(line.split()[-1])
    raise AssertionError(f"no metric {prefix} in\n{text}")


# --------------------------------------------------------------------------------------------- processes


def events(path, ev=None) -> list[dict]:
    try:
        lines = path.read_text().splitlines(keepends=True)
    except FileNotFoundError:
        return []
    out = [json.loads(line) for line in lines if line.endswith("\n")]
    return [e for e in out if ev is None or e["ev"] == ev]


def segments(path) -> list[list[int]]:
    """Versions delivered by each incarnation of a node (its event log spans restarts)."""
    segs: list[list[int]] = []
    for e in events(path):
        if e["ev"] == "start":
            segs.append([])
        elif e["ev"] == "delivered":
            segs[-1].append(e["v"])
    return segs




@pytest.mark.integration
@pytest.mark.slow
def test_daemons_with_engines_relay_and_controller_killed_nodes_restarted(tmp_path, model_dir, procs):
    n = 4
    store, gates, record = tmp_path / "store", tmp_path / "gates", tmp_path / "rec.jsonl"
    store.mkdir()
    store_log, store_ready = tmp_path / "store.log", tmp_path / "store.port"
    procs.spawn("s3", ["-m", "bench.netsim", "s3serve", str(store), "--port", "0", "--log", str(store_log),
                       "--ready", str(store_ready)])
    procs.trainer(store, model_dir, 5, gate_dir=gates, record=record)  # versions 0F 1 2 3F 4, one per gate
    ready = {r: tmp_path / f"engine{r}.ready" for r in range(n)}
    for r in range(n):
        procs.spawn(f"engine{r}", ["-m", "syncd.engine.control_server", "--model", str(model_dir), "--port", "0",
                                   "--ready-file", str(ready[r])])
    url = {r: procs.wait(lambda r=r: json.loads(ready[r].read_text())["url"], f"engine {r} to serve", 120)
           for r in range(n)}
    endpoint = "http://127.0.0.1:%s" % procs.wait(lambda: store_ready.read_text(), "the store's S3 endpoint", 30)
    ports = {r: free_port() for r in range(n)}
    peers = ",".join(f"{r}=127.0.0.1:{p}" for r, p in ports.items())
    secret_file = tmp_path / "cluster.secret"
    secret_file.write_text(SECRET)
    env = {**s3_env(), "SYNCD_CLUSTER_SECRET_FILE": str(secret_file), "SYNCD_CLUSTER_PEERS": peers}
    cache = {r: tmp_path / f"node{r}" for r in range(n)}
    log = {r: tmp_path / f"node{r}.events" for r in range(n)}
    daemon = {}

    def start(r):
        throttle = "40000" if r == 3 else "150000"  # rank 3 relays slowly: its children are mid-shard when it dies
        daemon[r] = procs.spawn(f"daemon{r}", [
            "-m", "syncd.app.cli", "--run-id", RUN, "--store", "s3://simstore", "--endpoint", endpoint,
            "--cache-dir", str(cache[r]), "--engine", f"e{r}={url[r]}", "--engine-check-s", "0.2",
            "--metrics-port", "0", "--cluster-rank", str(r), "--cluster-heartbeat-s", "0.3",
            "--cluster-dead-after-s", "1.5", "--cluster-poll-s", "0.2", "--cluster-no-fsync",
            "--cluster-chunk-bytes", "4096", "--cluster-stall-s", "1.5", "--cluster-throttle-bps", throttle,
            "--cluster-events", str(log[r])], env)

    def on_version(ranks, v):
        rec = procs.wait(lambda: trainer_record(record)[v]["checksums"], f"the trainer to publish version {v}", 60)
        procs.wait(lambda: all(engine_version(url[r]) == v for r in ranks), f"engines {ranks} at version {v}", 90)
        for r in ranks:
            assert engine_checksums(url[r]) == rec, f"engine {r}: checksums differ from the trainer's at {v}"

    for r in range(n):
        start(r)
    procs.wait(lambda: all(any(len(e["live"]) == n for e in events(log[r], "live")) for r in range(n)),
               "all four nodes to see each other", 60)

    # a relay dies -9 mid-broadcast: its children resume from other sources
    open_gates(gates, 0)
    procs.wait(lambda: any(e["src"] == 3 for r in range(3) for e in events(log[r], "pulling")), "a pull from rank 3",
               60)
    kill9(daemon[3])
    killed = {3: time.time()}
    on_version((0, 1, 2), 0)
    switches = [e for r in range(3) for e in events(log[r], "switch") if e["src"] == 3 and "Error" in e["why"]]
    assert switches, "a child of the dead relay moved to another source"

    # the controller dies -9 while versions 1, 2, 3F are planned and spread
    open_gates(gates, 1, 2, 3)
    procs.wait(lambda: any(e["v"] == 3 for e in events(log[1], "plan")), "the plan of version 3", 60)
    kill9(daemon[0])
    killed[0] = time.time()
    procs.wait(lambda: any(e["term"] >= 2 for e in events(log[1], "controller")), "rank 1 to take over", 30)
    on_version((1, 2), 3)

    # both come back: the old controller's engine kept its version, the relay's engine may have none
    e0, e3 = engine_version(url[0]), engine_version(url[3])
    assert e0 is not None
    back_at = time.time()
    start(0)
    start(3)
    procs.wait(lambda: all(any(len(e["live"]) == n and e["t"] > back_at for e in events(log[r], "live"))
                           for r in (0, 3)), "the restarted nodes to see everyone", 60)
    open_gates(gates, 4)
    on_version(range(n), 4)

    # versions in order, none skipped or repeated, on every node and every incarnation
    for r in range(n):
        for seg in segments(log[r]):
            assert seg == list(range(seg[0], seg[0] + len(seg))) if seg else True, f"node {r} delivered {seg}"
    for r in (1, 2):
        assert segments(log[r]) == [[0, 1, 2, 3, 4]], f"node {r}"
    # a restarted node continues after its engines' version (not after what its cluster node had received)
    d0 = events(log[0], "start")[-1]["delivered"]
    again = segments(log[0])[-1]
    assert d0 is not None and d0 >= e0 and again == list(range(d0 + 1, 5)), (e0, d0, again)
    d3 = events(log[3], "start")[-1]["delivered"]
    if e3 is None:  # no history: the node starts at the newest full version and the engine is rebuilt from it
        assert d3 is None and segments(log[3])[-1] == [3, 4], segments(log[3])
    restarted_at = events(log[3], "start")[-1]["t"]
    caught_up = [e for e in events(log[3], "store_read") if e["v"] < 4 and e["t"] >= restarted_at]
    assert sum(e["bytes"] for e in caught_up) == 0, "the restarted relay caught up from its peers"
    updates = procs.wait(lambda: (u := [x["version"] for x in json.loads((cache[0] / f"status-{RUN}.json")
                                                                    .read_text())["updates"]]) and u[-1] == 4 and u,
                         "daemon 0's status file to record version 4")  # written just after the engine answers
    assert updates == sorted(set(updates)) and updates[-1] == 4 and all(v > d0 for v in updates), updates

    # the store, counted at the store: each shard about once
    sizes = {v: read_manifest(Store(store), RUN, v, signing_key=KEY).total_bytes for v in range(5)}
    served: dict[int, int] = {}
    for e in read_store_log(store_log):
        if "/shards/" in e["key"]:
            v = int(e["key"].split("/versions/")[1].split("/")[0])
            served[v] = served.get(v, 0) + e["bytes"]
    # a root killed mid-read costs at most its shards once more (docs/cluster.md, "Store reads")
    lost_roots = sum(max((int(e["roots"].get(str(k), 0)) for r in range(n) for e in events(log[r], "plan")
                          if e["v"] == v and e["t"] <= t), default=0)
                     for k, t in killed.items() for v in sizes)
    assert all(served.get(v, 0) >= sizes[v] for v in sizes), (served, sizes)
    assert sum(served.values()) <= 1.05 * sum(sizes.values()) + lost_roots, (served, sizes, lost_roots)
    # nothing is killed during version 4: a shard is read again only when a plan moved its root (a node that
    # looked dead or stalled; on a starved machine a pause of every process looks like that), once per move
    m4 = read_manifest(Store(store), RUN, 4, signing_key=KEY)
    roots4: dict[int, set[int]] = {}
    for r in range(n):
        for e in events(log[r], "plan"):
            if e["v"] == 4:
                for i, root in enumerate(e["shard_roots"]):
                    roots4.setdefault(i, set()).add(root)
    moved = sum(m4.shards[i].size * (len(rs) - 1) for i, rs in roots4.items())
    assert served[4] <= 1.05 * sizes[4] + moved, ("version 4's shards read more than once per root", served[4],
                                                  sizes[4], roots4)

    # the cluster's counters: Prometheus and syncd status; a stranger is refused and counted
    async def stranger():
        with pytest.raises(AuthError):
            await auth.connect("127.0.0.1", ports[2], ClusterSecret(b"not-the-cluster-secret!!"), rank=9,
                               role="data")

    status_file = cache[2] / f"status-{RUN}.json"
    refused = json.loads(status_file.read_text())["cluster"]["refused_connections"]  # peers killed mid-handshake
    asyncio.run(stranger())
    procs.wait(lambda: json.loads(status_file.read_text())["cluster"]["refused_connections"] == refused + 1,
               "the refusal in the status file", 20)
    text = urllib.request.urlopen(json.loads(status_file.read_text())["metrics_url"], timeout=10).read().decode()
    assert metric(text, "syncd_cluster_refused_connections_total") == refused + 1
    assert metric(text, 'syncd_cluster_received_bytes_total{source="peers"}') > 0
    assert metric(text, "syncd_cluster_term") >= 2 and metric(text, "syncd_cluster_delivered_version") == 4
    out = io.StringIO()
    args = cli._resolve(cli.build_parser().parse_args(["status", "--status-file", str(status_file)]))
    assert commands.status(args, out) == 0, out.getvalue()
    assert "cluster: rank 2" in out.getvalue() and f"refused connections {refused + 1}," in out.getvalue(), \
        out.getvalue()

    # SIGTERM: the daemon finishes what it does, stops its cluster node and exits 0
    daemon[2].send_signal(signal.SIGTERM)
    assert daemon[2].wait(timeout=60) == 0, procs.logs()
    assert json.loads(status_file.read_text())["state"] == "stopped"
    assert events(log[2])[-1]["ev"] == "stop"
