"""Cluster broadcast benchmark: time to get one version onto every node of a simulated cluster.

A real model (Qwen2-style, bf16, sized to ``--size-mib``) takes real AdamW steps; each step is published
as a full version (``syncd.trainer.WeightPublisher``) to a file store that an S3 endpoint serves
(``python -m bench.netsim s3serve``; it counts every byte it sends). For each cluster size N a fresh
cluster of N ``python -m syncd.cluster.node`` processes distributes a first version (warm-up), then
``--repeats`` more; the figure is, per version, the time from the controller's plan to the last node's
delivery (the detection delay of polling is reported apart).

* **shaped** (default when root and ``ip netns`` are available): the store and every node each in a network
  namespace on one bridge, every link shaped by ``tc tbf`` to ``--rate-mbit`` in both directions, so
  the network, not this machine's CPU, is the limit. Baselines measured in the same run over the same
  links: one point-to-point TCP transfer of S bytes between two nodes, one node reading S bytes from the
  store on its own (what each node pays without a cluster), and the physical limit S / B.
* **unshaped**: the same on loopback (127.0.0.1), bound by this machine; the baseline is one loopback TCP
  transfer of S bytes.

Also reported: bytes the store served per version over S (goal: about 1, each byte over the long link
once), and completion over the single transfer (goal: at most 1.3 for every N, not growing with N).

    python -m bench.broadcast                            # N = 2, 4, 8, 16; shaped and unshaped
    python -m bench.broadcast --nodes 2 --size-mib 2 --repeats 1 --mode unshaped   # what the test runs

Writes JSON (``--json``); ``--plot`` draws completion against N with the baselines.
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
from bench._timing import Stopwatch

log = logging.getLogger("bench.broadcast")
RUN = "bench"
KEY = "bench-broadcast-signing-key-0123456789"


# ---------------------------------------------------------------------------------------------- the weights


def make_states(size_mib: float, n: int, seed: int = 0) -> list[dict]:
    """bf16 weights of a Qwen2-style model of about ``size_mib`` MiB after each of ``n - 1`` real AdamW
    steps (the first is the initial point)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from syncd.lazy import quiet_optional_imports

    quiet_optional_imports()
    hidden, layers = 128, 2
    per_layer = 4 * hidden * hidden + 3 * hidden * 352 + 4 * hidden
    vocab = max(256, int((size_mib * (1 << 20) / 2 - layers * per_layer) / (2 * hidden)))
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=352, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(seed)
    snap = lambda: {k: v.detach().to(torch.bfloat16).clone() for k, v in model.state_dict().items()}  # noqa: E731
    out = [snap()]
    for _ in range(n - 1):
        x = torch.randint(0, vocab, (2, 16), generator=gen)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(snap())
    return out


# ---------------------------------------------------------------------------------------------- baselines


_RECV = r"""
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1)
print("ready", flush=True)
c, _ = s.accept(); n = int(sys.argv[3]); buf = bytearray(1 << 20); got = 0; t0 = None
while got < n:
    k = c.recv_into(buf)
    if not k: break
    if t0 is None: t0 = time.time()
    got += k
c.sendall(b"k"); print(got, flush=True)
"""

_SEND = r"""
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2]))); n = int(sys.argv[3]); blk = b"\0" * (1 << 20)
t0 = time.perf_counter(); left = n
while left > 0:
    k = min(left, len(blk)); c.sendall(blk[:k]); left -= k
c.recv(1); print(time.perf_counter() - t0, flush=True)
"""


def tcp_transfer(nbytes: int, host: str, port: int, recv_prefix=(), send_prefix=()) -> float:
    """Seconds to send ``nbytes`` over one TCP connection (until the receiver acknowledged all of it)."""
    r = subprocess.Popen([*recv_prefix, sys.executable, "-c", _RECV, host, str(port), str(nbytes)],
                         stdout=subprocess.PIPE, text=True)
    try:
        assert r.stdout.readline().strip() == "ready"
        out = subprocess.run([*send_prefix, sys.executable, "-c", _SEND, host, str(port), str(nbytes)],
                             capture_output=True, text=True, timeout=600, check=True).stdout
        r.wait(30)
        return float(out.strip())
    finally:
        if r.poll() is None:
            r.kill()


_STORE_READ = r"""
import sys, time
from syncd.store import Store
from syncd.versions import read_manifest, fetch_shards
store = Store(sys.argv[1], endpoint=sys.argv[2])
m = read_manifest(store, sys.argv[3], int(sys.argv[4]), signing_key=sys.argv[5])
t0 = time.perf_counter(); fetch_shards(store, sys.argv[3], m); print(time.perf_counter() - t0)
"""


def store_read(prefix, url: str, endpoint: str, version: int, env: dict) -> float:
    out = subprocess.run([*prefix, sys.executable, "-c", _STORE_READ, url, endpoint, RUN, str(version), KEY],
                         capture_output=True, text=True, timeout=600, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"store read failed: {out.stderr[-2000:]}")
    return float(out.stdout.strip())


# ---------------------------------------------------------------------------------------------- one cluster


class Env:
    """Where the store and the nodes run: on loopback, or each in a namespace of a shaped network."""

    def __init__(self, workdir: Path, store_dir: Path, nmax: int, shaped: bool, rate_mbit: float):
        from bench import netsim as sim

        self.sim, self.shaped = sim, shaped
        self.workdir, self.store_dir = workdir, store_dir
        self.net = None
        self.srv = None
        hosts = ["st"] + [f"n{i}" for i in range(nmax)]
        if shaped:
            self.net = sim.Netns(hosts)
            self.net.__enter__()
            for h in hosts:
                self.net.shape(h, rate_mbit * 1e6)
        self.store_host = self.ip("st")
        self.log = workdir / "store.log"
        port_file = workdir / "store.port"
        self.srv = subprocess.Popen([*self.prefix("st"), sys.executable, "-m", "bench.netsim", "s3serve",
                                     str(store_dir), "--host", self.store_host, "--port", "0", "--log", str(self.log),
                                     "--ready", str(port_file)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while not port_file.exists():
            if time.monotonic() > deadline or self.srv.poll() is not None:
                raise RuntimeError("the S3 endpoint did not start")
            time.sleep(0.05)
        self.endpoint = f"http://{self.store_host}:{port_file.read_text()}"
        self.env = {**os.environ, **sim.s3_env(), "AWS_ENDPOINT_URL": self.endpoint}

    def prefix(self, host: str) -> list[str]:
        return self.net.exec_prefix(host) if self.net else []

    def ip(self, host: str) -> str:
        return self.net.ip(host) if self.net else "127.0.0.1"

    def served(self) -> list[dict]:
        return self.sim.read_store_log(self.log)

    def close(self) -> None:
        from syncd.procs import stop_process

        if self.srv is not None:
            stop_process(self.srv, grace_s=5)
        if self.net is not None:
            self.net.close()


def run_cluster(env: Env, n: int, states, repeats: int, args, publish) -> dict:
    """A fresh cluster of ``n`` nodes distributes ``repeats + 1`` versions; returns per-version figures."""
    from bench import netsim as sim

    run = f"{RUN}"
    addrs = {r: (env.ip(f"n{r}"), 7400 if env.shaped else sim.free_port()) for r in range(n)}
    procs = sim.NodeProcs(env.workdir / f"{'shaped' if env.shaped else 'loop'}{n}", store="s3://simstore",
                          run_id=run, secret="hex:" + secrets.token_hex(32), signing_key=KEY, addrs=addrs,
                          prefix={r: env.prefix(f"n{r}") for r in range(n)}, env=env.env,
                          args=["--heartbeat-s", "0.5", "--poll-s", "0.1", "--fanout", str(args.fanout),
                                "--chunk-bytes", str(args.chunk_kib << 10), "--store-streams", str(args.store_streams),
                                *(["--no-fsync"] if not args.fsync else [])])
    rows = []
    try:
        v = publish(0)
        procs.start_all()
        for k in range(repeats + 1):
            if k:
                v = publish(k)
            t_pub = time.time()
            procs.wait(lambda: all(v in procs.delivered(r) for r in range(n)), 600, f"version {v} on {n} nodes",
                       poll=0.02)
            plan_t = min(e["t"] for r in range(n) for e in procs.events(r, "plan") if e["v"] == v)
            done_t = max(e["t"] for r in range(n) for e in procs.events(r, "delivered") if e["v"] == v)
            prefix = f"runs/{run}/versions/{v:012d}/shards/"
            served = sum(e["bytes"] for e in env.served() if e["key"].startswith(prefix))
            rows.append({"version": v, "warmup": k == 0, "completion_s": done_t - plan_t,
                         "detect_s": max(0.0, plan_t - t_pub), "store_bytes": served})
    finally:
        procs.stop_all()
    return {"nodes": n, "versions": rows}


# ---------------------------------------------------------------------------------------------- main


def run(args) -> dict:
    import torch

    from bench import netsim as sim
    from syncd.versions import read_manifest
    from syncd.trainer import WeightPublisher

    torch.set_num_threads(1)
    modes = ["shaped", "unshaped"] if args.mode == "both" else [args.mode]
    if "shaped" in modes and (why := sim.netns_available()):
        if args.mode == "shaped":
            raise RuntimeError(f"shaped mode needs network namespaces: {why}")
        print(f"skipping the shaped network: {why}")
        modes.remove("shaped")
    per_cluster = args.repeats + 1
    total = per_cluster * len(args.nodes) * len(modes)
    sw = Stopwatch()
    states = make_states(args.size_mib, min(total, 8))
    print(f"trained {len(states)} states in {sw.elapsed:.1f}s")
    result = {"bench": "broadcast", "host": platform.node(), "cpus": os.cpu_count(), "args": vars(args), "modes": {}}
    with tempfile.TemporaryDirectory(prefix="syncd-bcast-") as tmp:
        tmp = Path(args.workdir) if args.workdir else Path(tmp)
        tmp.mkdir(parents=True, exist_ok=True)
        store_dir = tmp / "store"
        store_dir.mkdir()
        os.chmod(tmp, 0o755)
        pub = WeightPublisher(store_dir, RUN, signing_key=KEY, full_every=1, shard_bytes=args.shard_mib << 20)
        counter = [0]

        def publish(_k: int) -> int:
            step = counter[0]
            pub.publish(states[step % len(states)], step)
            pub.flush()
            counter[0] += 1
            return pub.history[-1].version

        size = None
        for mode in modes:
            (tmp / mode).mkdir()
            env = Env(tmp / mode, store_dir, max(args.nodes), mode == "shaped", args.rate_mbit)
            try:
                clusters = [run_cluster(env, n, states, args.repeats, args, publish) for n in args.nodes]
                if size is None:
                    v = clusters[0]["versions"][-1]["version"]
                    m = read_manifest(store_dir, RUN, v, signing_key=KEY)
                    size = m.total_bytes
                    shards = [s.size for s in m.shards]
                # baselines in the same run, over the same links
                tcp = [tcp_transfer(size, env.ip("n1"), 7500 + i if env.shaped else sim.free_port(), env.prefix("n1"),
                                    env.prefix("n0"))
                       for i in range(args.repeats)]
                direct = [store_read(env.prefix("n0"), "s3://simstore", env.endpoint, v, env.env)
                          for _ in range(args.repeats)]
            finally:
                env.close()
            single = statistics.median(tcp)
            rows = []
            for c in clusters:
                meas = [x for x in c["versions"] if not x["warmup"]]
                comp = statistics.median(x["completion_s"] for x in meas)
                rows.append({"nodes": c["nodes"], "completion_s": comp, "ratio_single": comp / single,
                             "store_over_S": statistics.median(x["store_bytes"] / size for x in meas),
                             "detect_s": statistics.median(x["detect_s"] for x in meas),
                             "all": c["versions"]})
            limit = size * 8 / (args.rate_mbit * 1e6) if mode == "shaped" else None
            result["modes"][mode] = {"S_bytes": size, "shards": shards, "single_tcp_s": single,
                                     "single_tcp_all": tcp, "store_direct_s": statistics.median(direct),
                                     "S_over_B_s": limit, "rows": rows}
            print_mode(mode, result["modes"][mode], args)
        pub.close()
    return result


def print_mode(mode: str, r: dict, args) -> None:
    S = r["S_bytes"]
    head = f"{mode}: S = {S / 2**20:.1f} MiB in {len(r['shards'])} shards (largest {max(r['shards']) / 2**20:.1f} MiB)"
    if r["S_over_B_s"]:
        head += f", every link {args.rate_mbit:g} Mbit/s: S/B = {r['S_over_B_s']:.2f}s"
    print(head)
    print(f"  single TCP transfer of S (baseline): {r['single_tcp_s']:.2f}s; one node reading S from the store "
          f"alone: {r['store_direct_s']:.2f}s")
    print(f"  {'N':>3} {'completion':>11} {'/ single':>9} {'/ (S/B)':>8} {'store bytes / S':>16} {'detect':>7}")
    for row in r["rows"]:
        sb = f"{row['completion_s'] / r['S_over_B_s']:8.2f}" if r["S_over_B_s"] else f"{'-':>8}"
        print(f"  {row['nodes']:>3} {row['completion_s']:>10.2f}s {row['ratio_single']:>9.2f} {sb} "
              f"{row['store_over_S']:>16.3f} {row['detect_s']:>6.2f}s")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.broadcast", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4, 8, 16])
    p.add_argument("--size-mib", type=float, default=16.0, help="version size S (bf16 weights)")
    p.add_argument("--shard-mib", type=int, default=1, help="publisher shard size (big tensors get their own)")
    p.add_argument("--rate-mbit", type=float, default=40.0, help="every link's bandwidth B (shaped mode)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--fanout", type=int, default=2)
    p.add_argument("--chunk-kib", type=int, default=64,
                   help="chunk size; the pipeline adds about depth x chunk / (B / fanout) to the completion")
    p.add_argument("--store-streams", type=int, default=0, help="pacing of store reads (0: none)")
    p.add_argument("--fsync", action="store_true", help="fsync every shard (off: measure the network)")
    p.add_argument("--mode", choices=["shaped", "unshaped", "both"], default="both")
    p.add_argument("--workdir", default=None, help="keep the cluster's files (event logs) here")
    output_flags(p, "broadcast")
    return p


def rows(res: dict) -> list[Row]:
    """The shared columns: per mode and N, the completion against one point-to-point TCP transfer of S."""
    out = []
    for mode, r in res["modes"].items():
        device = f"netns {res['args']['rate_mbit']:g} Mbit/s" if mode == "shaped" else "loopback"
        for row in r["rows"]:
            out.append(Row(f"tree broadcast ({mode})", row["completion_s"], 1 / row["ratio_single"],
                           "one TCP transfer of S", f"N={row['nodes']} S={r['S_bytes'] / 2**20:.1f} MiB", device))
    return out


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    res = run(args)
    return finish("broadcast", args, res, rows(res), lambda path: plot(res, path))


def plot(res: dict, path):
    """Per mode: the time to get a version onto every node against N, next to one point-to-point transfer of the
    version, one node reading it from the store alone, and (shaped) the physical limit S / B."""
    from bench._plot import pyplot, save

    plt = pyplot()
    modes = res["modes"]
    fig, axes = plt.subplots(1, len(modes), figsize=(5.5 * len(modes), 4.2), squeeze=False)
    for ax, (mode, r) in zip(axes[0], sorted(modes.items())):
        ns = [row["nodes"] for row in r["rows"]]
        ax.plot(ns, [row["completion_s"] for row in r["rows"]], "o-", lw=2, label="every node has the version")
        ax.axhline(r["single_tcp_s"], color="C1", ls="--", label="one TCP transfer of S (baseline)")
        ax.axhline(r["store_direct_s"], color="C2", ls=":", label="one node reading S from the store")
        if r.get("S_over_B_s"):
            ax.axhline(r["S_over_B_s"], color="black", lw=0.8, label="S / B (physical limit)")
        ax.set(xlabel="nodes N", ylabel="seconds", ylim=(0, None), xticks=ns,
               title=f"{mode}: S = {r['S_bytes'] / 2**20:.1f} MiB")
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle("tree broadcast: completion against cluster size", fontsize=10)
    return save(fig, path)


if __name__ == "__main__":
    sys.exit(main())
