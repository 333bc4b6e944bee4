"""Cluster control-plane benchmark: controller failover with etcd against the embedded election, and store reads
per shard around a network partition.

* **Failover** (loopback): a fresh cluster of ``--nodes`` ``python -m syncd.cluster.node`` processes delivers a first
  version; its controller is killed (SIGKILL) and the next version published at once. The figure is the time from
  the kill to the new controller's first plan (its ``plan`` event), median over ``--repeats`` fresh clusters, for
  the election through etcd (``--etcd``, a lease of ``--ttl-s``) and for the embedded one (dead after three
  heartbeats), in the same run with the same ``--heartbeat-s``.
* **Partition** (network namespaces; needs root): the store, etcd and every node each in a namespace on one bridge.
  Once a first version is everywhere, the link between two halves is cut (blackhole routes both ways; the store
  stays reachable from both): the controller and one other node on one side, etcd and the rest on the other, while
  a version is published; two more are published during the partition, the link is healed and one more is
  published. The figures, counted at the store (the simulated S3 endpoint logs every object body it sends): store
  reads per shard of the versions published during the partition window (the one in flight at the cut included)
  and of those after it. With etcd the cut-off side cannot elect a controller, so a shard crosses the long link
  once; ``--partition both`` also runs the embedded election, where each side elects one and reads the shard.

    python -m bench.cluster_failover                               # defaults: 5 nodes, 3 repeats, both elections
    python -m bench.cluster_failover --nodes 4 --repeats 1 --heartbeat-s 0.25 --ttl-s 2 --partition etcd

``--json`` fields: ``failover_s_etcd``, ``failover_s_builtin`` (medians), ``reads_per_shard_during``,
``reads_per_shard_after`` (etcd; None without namespaces, ``partition_skipped`` says why), and the runs in detail.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench._report import Row, finish, output_flags
from bench.netsim.netns import Lab

log = logging.getLogger("bench.cluster_failover")
KEY = "bench-failover-signing-key-0123456789"


def controllers(c, ranks) -> list[tuple[float, int, int]]:
    """``(time, rank, term)`` of every takeover in the nodes' event logs, in time order."""
    return sorted((e["t"], r, e["term"]) for r in ranks for e in c.events(r, "controller"))


def node_args(election: str, etcd_url: str | None, heartbeat_s: float, ttl_s: int) -> list[str]:
    args = ["--heartbeat-s", str(heartbeat_s), "--poll-s", "0.1", "--no-fsync", "--chunk-bytes", "8192",
            "--stall-s", str(max(1.5, 6 * heartbeat_s))]
    return args + (["--etcd", etcd_url, "--etcd-ttl-s", str(ttl_s)] if election == "etcd" else [])


def settle(c, n: int, wait_s: float) -> None:
    """Wait until every node sees all ``n`` and some node controls."""
    c.wait(lambda: all(any(e["ev"] == "live" and len(e["live"]) == n for e in c.events(r)) for r in range(n)),
           wait_s, f"all {n} nodes see each other")
    c.wait(lambda: controllers(c, range(n)), wait_s, "a controller")


# ---------------------------------------------------------------------------------------------- failover


def failover_once(workdir: Path, states, election: str, n: int, heartbeat_s: float, ttl_s: int) -> dict:
    """One fresh loopback cluster: kill its controller, publish; seconds from the kill to the new controller's
    first plan (and to its takeover)."""
    from bench import netsim as sim
    from bench.netsim.etcd import EtcdServer
    from syncd.trainer import WeightPublisher

    store = workdir / "store"
    store.mkdir(parents=True)
    run_id = "fo"
    wait_s = 30 * max(ttl_s, heartbeat_s)
    etcd = EtcdServer(workdir / "etcd").start() if election == "etcd" else None
    c = sim.NodeProcs(workdir / "nodes", store=str(store), run_id=run_id, secret="hex:" + secrets.token_hex(32),
                      signing_key=KEY, addrs={r: ("127.0.0.1", sim.free_port()) for r in range(n)},
                      args=node_args(election, etcd and etcd.url, heartbeat_s, ttl_s))
    pub = WeightPublisher(store, run_id, signing_key=KEY, full_every=3, shard_bytes=16 << 10)

    def publish(step: int) -> int:
        pub.publish(states[step], step)
        pub.flush()
        return pub.history[-1].version

    try:
        c.start_all()
        settle(c, n, wait_s)
        v0 = publish(0)
        c.wait(lambda: all(v0 in c.delivered(r) for r in range(n)), wait_s, f"version {v0} everywhere")
        _, old, old_term = controllers(c, range(n))[-1]
        t_kill = time.time()
        c.kill(old)
        v1 = publish(1)
        rest = [r for r in range(n) if r != old]
        _, new, new_term = c.wait(lambda: [x for x in controllers(c, rest) if x[2] > old_term], wait_s,
                                  "a new controller")[0]
        first = c.wait(lambda: sorted(e["t"] for e in c.events(new, "plan") if e["term"] == new_term
                                      and e["sender"] == new), wait_s, "the new controller's first plan")[0]
        c.wait(lambda: all(v1 in c.delivered(r) for r in rest), wait_s, f"version {v1} on the survivors")
        took = next(t for t, r, term in controllers(c, rest) if term == new_term)
        return {"election": election, "failover_s": first - t_kill, "takeover_s": took - t_kill, "killed": old,
                "new": new}
    finally:
        c.stop_all()
        pub.close()
        if etcd is not None:
            etcd.stop()


# ---------------------------------------------------------------------------------------------- partition


class NetLab(Lab):
    """The store (a simulated S3 endpoint over ``store_dir``), etcd and ``n`` node processes, each in its own
    network namespace on one bridge (:class:`bench.netsim.Netns`); :meth:`cut` and :meth:`heal` a partition
    between node halves, the store reachable from both. Hosts: ``st``, ``et``, ``n0``.. ``args``: more flags for
    every node. ``engines``: a model folder: each node is then a daemon keeping a reference engine of that model
    (in the node's namespace) current, and a watcher on host ``ob`` (cut off from nobody) samples every engine's
    version and checksums into :attr:`watch_log` (:mod:`bench.netsim.watch`). Needs root. A context manager:
    every process and namespace is gone on exit."""

    def __init__(self, workdir, store_dir, n: int, *, run_id: str, signing_key: str, election: str = "etcd",
                 heartbeat_s: float = 0.25, ttl_s: int = 2, secret: str | None = None, args=(),
                 engines: Path | None = None):
        from bench import netsim as sim
        from bench.netsim.etcd import EtcdServer

        self.workdir, self.n = Path(workdir), n
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.net = sim.Netns(["st", "et", *(f"n{r}" for r in range(n)), *(["ob"] if engines else [])])
        self.model = engines
        self.watch_log = self.workdir / "watch.jsonl"
        self.engine_procs: list[subprocess.Popen] = []
        token = self.workdir / "engine-token"
        engine_env = {"SYNCD_ENGINE_TOKEN_FILE": str(token)} if engines else {}
        if engines:
            token.write_text(secrets.token_hex(32))
            token.chmod(0o600)
        self.engine_urls = {r: f"http://{self.net.ip(f'n{r}')}:8101" for r in range(n)} if engines else {}
        self.store_log = self.workdir / "store.log"
        self._store_cmd = [*self.net.exec_prefix("st"), sys.executable, "-m", "bench.netsim", "s3serve",
                           str(store_dir), "--host", self.net.ip("st"), "--port", "8080", "--log", str(self.store_log),
                           "--ready", str(self.workdir / "store.port")]
        self.etcd = (EtcdServer(self.workdir / "etcd", host=self.net.ip("et"), client_port=2379, peer_port=2380,
                                prefix=self.net.exec_prefix("et")) if election == "etcd" else None)
        self.nodes = sim.NodeProcs(
            self.workdir / "nodes", store="s3://simstore", run_id=run_id,
            secret=secret or "hex:" + secrets.token_hex(32), signing_key=signing_key, addrs={r: (self.net.ip(f"n{r}"), 7400) for r in range(n)},
            prefix={r: self.net.exec_prefix(f"n{r}") for r in range(n)},
            env={**sim.s3_env(), "AWS_ENDPOINT_URL": f"http://{self.net.ip('st')}:8080", **engine_env},
            args=[*node_args(election, self.etcd and self.etcd.url, heartbeat_s, ttl_s), *args],
            engines=self.engine_urls)
        self.srv: subprocess.Popen | None = None
        self.routes: list[tuple[str, str]] = []

    def start(self) -> None:
        self.net.setup()
        self.srv = subprocess.Popen(self._store_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.nodes.wait(lambda: (self.workdir / "store.port").exists(), 20, "the store's S3 endpoint")
        if self.etcd is not None:
            self.etcd.start()
        if self.model is not None:
            self._start_engines()

    def _start_engines(self) -> None:
        env = {**os.environ, **self.nodes.env}
        ready = {r: self.workdir / f"engine{r}.ready" for r in range(self.n)}
        for r in range(self.n):
            with open(self.workdir / f"engine{r}.log", "ab") as log_file:
                self.engine_procs.append(subprocess.Popen(
                    [*self.net.exec_prefix(f"n{r}"), sys.executable, "-m", "syncd.engine.control_server", "--model",
                     str(self.model), "--host", self.net.ip(f"n{r}"), "--port", "8101", "--ready-file",
                     str(ready[r])], env=env, stdout=log_file, stderr=log_file, stdin=subprocess.DEVNULL))
        self.nodes.wait(lambda: all(f.exists() for f in ready.values()), 300, "every engine to serve")
        with open(self.workdir / "watch.log", "ab") as log_file:
            self.engine_procs.append(subprocess.Popen(
                [*self.net.exec_prefix("ob"), sys.executable, "-m", "bench.netsim", "watch",
                 *(f"e{r}={u}" for r, u in self.engine_urls.items()), "--out", str(self.watch_log)],
                env=env, stdout=log_file, stderr=log_file, stdin=subprocess.DEVNULL))

    def cut(self, side: set[str]) -> None:
        """Partition hosts ``side`` from the other hosts but the store (``st``) and the watcher (``ob``): blackhole
        routes both ways, so packets vanish as on a broken link (established connections stall, they do not
        reset)."""
        other = set(self.net.names) - set(side) - {"st", "ob"}
        for a in side:
            for b in other:
                for x, y in ((a, b), (b, a)):
                    self._route("add", x, y)
                    self.routes.append((x, y))

    def heal(self) -> None:
        while self.routes:
            self._route("del", *self.routes.pop())

    def _route(self, op: str, host: str, to: str) -> None:
        subprocess.run(["ip", "-n", self.net.ns(host), "route", op, "blackhole", f"{self.net.ip(to)}/32"],
                       check=True, capture_output=True)

    def store_reads(self) -> list[dict]:
        """Every shard body the store sent: ``{"key", "bytes", "rank"}`` (the reader's rank from its address)."""
        from bench import netsim as sim

        rank = {self.net.ip(f"n{r}"): r for r in range(self.n)}
        return [{"key": e["key"], "bytes": e["bytes"], "rank": rank.get(e["peer"])}
                for e in sim.read_store_log(self.store_log) if "/shards/" in e["key"]]

    def close(self) -> None:
        from syncd.procs import stop_process

        self.nodes.stop_all()
        for p in reversed(self.engine_procs):
            stop_process(p)
        if self.etcd is not None:
            self.etcd.stop()
        if self.srv is not None:
            stop_process(self.srv, grace_s=5)
        self.net.close()


def partition_run(lab: NetLab, publish, *, wait_s: float) -> dict:
    """The partition scenario (module docstring) on ``lab``; ``publish()`` publishes the next version and returns
    it. Returns the halves, the times (Unix seconds) of the cut and the heal, and the versions: ``before`` (on every
    node before the cut), ``window`` (published just before the cut), ``during``, ``after``."""
    c, n = lab.nodes, lab.n
    c.start_all()
    settle(c, n, wait_s)
    v0 = publish()
    c.wait(lambda: all(v0 in c.delivered(r) for r in range(n)), wait_s, f"version {v0} everywhere")
    ctrl = controllers(c, range(n))[-1][1]
    minority = {ctrl, (ctrl + 1) % n}
    majority = sorted(set(range(n)) - minority)
    v1 = publish()
    t_cut = time.time()
    lab.cut({f"n{r}" for r in minority})
    c.wait(lambda: [x for x in controllers(c, majority) if x[0] > t_cut], wait_s, "a controller on the majority side")
    during = [publish(), publish()]
    c.wait(lambda: all(during[-1] in c.delivered(r) for r in majority), wait_s, "the majority side to catch up")
    t_heal = time.time()
    lab.heal()
    after = publish()
    c.wait(lambda: all(after in c.delivered(r) for r in range(n)), wait_s, f"version {after} everywhere after healing")
    return {"minority": sorted(minority), "majority": majority, "t_cut": t_cut, "t_heal": t_heal,
            "before": [v0], "window": [v1], "during": during, "after": [after]}


def reads_per_shard(reads: list[dict], store_dir, run_id: str, versions) -> float:
    """Bytes the store sent of the shards of ``versions`` over their size: reads per shard."""
    from syncd.versions import read_manifest

    size = served = 0
    for v in versions:
        for s in read_manifest(store_dir, run_id, v, signing_key=KEY).shards:
            size += s.size
            served += sum(e["bytes"] for e in reads if e["key"] == f"runs/{run_id}/{s.key}")
    return served / size


def partition_figures(workdir: Path, states, election: str, n: int, heartbeat_s: float, ttl_s: int) -> dict:
    from syncd.trainer import WeightPublisher

    store = workdir / "store"
    store.mkdir(parents=True)
    os.chmod(workdir, 0o755)
    pub = WeightPublisher(store, "part", signing_key=KEY, full_every=3, shard_bytes=16 << 10)
    step = [0]

    def publish() -> int:
        pub.publish(states[step[0]], step[0])
        pub.flush()
        step[0] += 1
        return pub.history[-1].version

    try:
        with NetLab(workdir / "lab", store, n, run_id="part", signing_key=KEY, election=election,
                    heartbeat_s=heartbeat_s, ttl_s=ttl_s) as lab:
            res = partition_run(lab, publish, wait_s=30 * max(ttl_s, heartbeat_s))
            reads = lab.store_reads()
    finally:
        pub.close()
    res.update(election=election, reads_during=reads_per_shard(reads, store, "part", res["window"] + res["during"]),
               reads_after=reads_per_shard(reads, store, "part", res["after"]),
               reads_before=reads_per_shard(reads, store, "part", res["before"]))
    return res


# ---------------------------------------------------------------------------------------------- main


def run(args) -> dict:
    import torch

    from bench import netsim as sim
    from bench.broadcast import make_states

    torch.set_num_threads(1)
    states = make_states(args.size_mib, 8)
    out = {"bench": "cluster_failover", "host": platform.node(), "cpus": os.cpu_count(), "args": vars(args),
           "failover": [], "partition": [], "partition_skipped": None}
    with tempfile.TemporaryDirectory(prefix="syncd-failover-") as tmp:
        tmp = Path(args.workdir) if args.workdir else Path(tmp)
        for i in range(args.repeats):
            for election in ("etcd", "builtin"):
                r = failover_once(tmp / f"fo-{election}-{i}", states, election, args.nodes, args.heartbeat_s,
                                  args.ttl_s)
                print(f"failover ({election}, repeat {i}): {r['failover_s']:.2f}s to the first plan, "
                      f"{r['takeover_s']:.2f}s to the takeover")
                out["failover"].append(r)
        why = sim.netns_available() if args.partition != "none" else "not asked for (--partition none)"
        if why is None:
            for election in (["etcd", "builtin"] if args.partition == "both" else [args.partition]):
                r = partition_figures(tmp / f"part-{election}", states, election, args.nodes, args.heartbeat_s,
                                      args.ttl_s)
                print(f"partition ({election}): store reads per shard {r['reads_during']:.2f} during, "
                      f"{r['reads_after']:.2f} after")
                out["partition"].append(r)
        else:
            out["partition_skipped"] = why
            print(f"no partition run: {why}")
    med = {e: statistics.median(r["failover_s"] for r in out["failover"] if r["election"] == e)
           for e in ("etcd", "builtin")}
    part = {r["election"]: r for r in out["partition"]}
    out.update(failover_s_etcd=med["etcd"], failover_s_builtin=med["builtin"],
               reads_per_shard_during=part["etcd"]["reads_during"] if "etcd" in part else None,
               reads_per_shard_after=part["etcd"]["reads_after"] if "etcd" in part else None,
               reads_per_shard_during_builtin=part["builtin"]["reads_during"] if "builtin" in part else None)
    return out


def rows(res: dict) -> list[Row]:
    a = res["args"]
    sizes = f"N={a['nodes']} hb={a['heartbeat_s']:g}s ttl={a['ttl_s']}s"
    out = [Row("failover: etcd election", res["failover_s_etcd"], res["failover_s_builtin"] / res["failover_s_etcd"],
               "the embedded election", sizes, "loopback"),
           Row("failover: embedded election", res["failover_s_builtin"], 1.0, "itself", sizes, "loopback")]
    for r in res["partition"]:
        out.append(Row(f"partition ({r['election']}): reads/shard", None, None,
                       f"during {r['reads_during']:.2f}, after {r['reads_after']:.2f}", f"N={a['nodes']}", "netns"))
    return out


def plot(res: dict, path):
    """Failover times per election (every repeat and the median), and store reads per shard before, during and
    after the partition per election."""
    from bench._plot import pyplot, save

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    name = {"etcd": "etcd", "builtin": "embedded"}
    for i, e in enumerate(("etcd", "builtin")):
        xs = [r["failover_s"] for r in res["failover"] if r["election"] == e]
        axes[0].plot([i] * len(xs), xs, "o", alpha=0.6)
        axes[0].bar(i, statistics.median(xs), alpha=0.4, label=f"{name[e]}: {statistics.median(xs):.2f}s")
    axes[0].set(xticks=[0, 1], xticklabels=["etcd", "embedded"], ylabel="kill -> new controller's first plan (s)",
                title="controller failover")
    axes[0].legend(fontsize=8)
    for j, r in enumerate(res["partition"]):
        axes[1].bar([k + 0.4 * j for k in range(3)], [r["reads_before"], r["reads_during"], r["reads_after"]],
                    width=0.4, label=name[r["election"]])
    axes[1].axhline(1.0, color="black", lw=0.8)
    axes[1].set(xticks=[0.2, 1.2, 2.2], xticklabels=["before", "during", "after"], ylabel="store reads per shard",
                title="partition" if res["partition"] else f"partition: {res['partition_skipped']}")
    axes[1].legend(fontsize=8)
    return save(fig, path)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.cluster_failover", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=5, help="cluster size (at least 4: the partition leaves 2 vs N-2)")
    p.add_argument("--repeats", type=int, default=3, help="fresh clusters per election for the failover figure")
    p.add_argument("--heartbeat-s", type=float, default=1.0, help="heartbeat period of both elections")
    p.add_argument("--ttl-s", type=int, default=3, help="the etcd lease (at least 2; 3 matches dead-after at 1 s)")
    p.add_argument("--size-mib", type=float, default=0.25, help="weights per version (bf16, real AdamW steps)")
    p.add_argument("--partition", choices=["etcd", "builtin", "both", "none"], default="both")
    p.add_argument("--workdir", default=None, help="keep the clusters' files (event logs) here")
    output_flags(p, "cluster_failover")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.nodes < 4 or args.ttl_s < 2 or args.repeats < 1:
        print("cluster_failover: --nodes must be at least 4, --ttl-s at least 2, --repeats at least 1", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING)
    res = run(args)
    return finish("cluster_failover", args, res, rows(res), lambda path: plot(res, path))


if __name__ == "__main__":
    sys.exit(main())
