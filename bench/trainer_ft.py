"""The trainer's fault tolerance in numbers (issue 18): checkpoint stall, rebuild of a dead rank, goodput under
failures. Each figure next to its baseline, measured in the same process, medians of interleaved rounds.

    python -m bench.trainer_ft [--stall-params 25e6] [--rebuild-params 100e6] [--goodput-steps 40 --fail-every 10]
                               [--sections stall,rebuild,goodput,outage,elastic] [--json ft.json] [--plot ft.png]

* **stall**: a real AdamW training step of an MLP, three ways in interleaved rounds: no checkpoint, the per-step
  asynchronous :class:`syncd.trainer.ft.checkpoint.Checkpointer` (stall = the time the training thread spends in
  ``save`` and ``before_update``), and a synchronous ``torch.save`` of the same state (model, optimizer, RNG) plus
  fsync. Figures: the stall as a share of the no-checkpoint step, and sync stall / async stall. The physical floor of a
  non-overlapped snapshot is one memcpy of the state (measured).
* **rebuild**: the checkpoint of a ~``--rebuild-params`` model with its AdamW state, rebuilt by a new process's
  worth of work from a peer's replica (:func:`syncd.trainer.ft.replicas.fetch_checkpoint` from a :class:`ReplicaServer`
  in another process, over loopback, verified and parsed in memory as ``FaultTolerance.restore`` does; the copy to
  local disk happens afterwards, in the background) against the same bundle from the object store (``--store``,
  default a ``file://`` store in the work folder: a local disk, faster than any cloud object store), verified and
  parsed the same way, each loaded into a fresh model and optimizer. Projected to a 1T-parameter run: the per-node
  shard over the measured per-link rate, with the assumptions printed.
* **goodput**: the thin trainer (``python -m syncd.trainer.run --nproc 2 --checkpoint-dir``, offline on recorded
  rollouts, ``bench.ft_data``) killed with SIGKILL every ``--fail-every`` steps and resumed, against a
  failure-free run of the same steps: steps lost per failure (trained before the kill, minus the resume step)
  and goodput (steps per wall second, process starts included); ``--busy`` is the trainer's ``--checkpoint-busy``.
* **outage** (not in the default sections: it starts the RL stack): the trainer killed with SIGKILL mid-run while
  ``syncd rollouts`` keeps generating, restored after ``--outage-s`` (:mod:`bench.trainer_outage`): generation
  tokens/s before and during the outage, restart to the first step, prompts lost and duplicated.
* **elastic** (not in the default sections: it starts the RL stack): two replica groups on torchft fed by ``syncd
  rollouts``, the leading group killed with SIGKILL and restarted (:mod:`bench.trainer_elastic`): kill to the first
  step without it (shrink), to the survivor's first step as leader (takeover), restart to its first committed step
  (regrow), goodput against a failure-free run of the same steps.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from bench._plot import pyplot, save
from bench._report import Row, finish, output_flags
from bench.ft_goodput import bench_goodput
from bench.trainer_elastic import bench_elastic
from bench.trainer_outage import bench_outage
from bench._timing import clock, median, paired_rounds

__all__ = ["main"]

ROOT = Path(__file__).resolve().parents[1]


def _mlp(params: float, width: int):
    import torch

    layers = max(1, round(params / (width * width + width)))
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh())
                                 for _ in range(layers)])


def _state_bytes(model, opt) -> int:
    n = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return n + sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                   if hasattr(v, "numel"))


# ---------------------------------------------------------------------------------------------- stall


def bench_stall(args, work: Path) -> dict:
    import torch

    from syncd.trainer.ft.checkpoint import Checkpointer, capture_rng

    torch.manual_seed(0)
    model = _mlp(args.stall_params, args.width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    x = torch.randn(args.batch, args.width)
    ck = Checkpointer(work / "async", owner="bench", keep=2)  # the default: a write in flight is waited for
    steps = {"none": [], "async": [], "sync": []}
    stalls = {"async": [], "sync": []}
    n = [0]

    def step(mode: str) -> None:
        t0 = clock()
        model(x).pow(2).mean().backward()
        s0 = clock()
        if mode == "async":
            ck.before_update()
        s = clock() - s0
        opt.step()
        opt.zero_grad()
        n[0] += 1
        if mode == "async":
            s0 = clock()
            ck.save(n[0], model, opt)
            s += clock() - s0
        elif mode == "sync":
            s0 = clock()
            path = work / "sync.pt"
            with open(path, "wb") as f:
                torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "rng": capture_rng()}, f)
                f.flush()
                os.fsync(f.fileno())
            s = clock() - s0
        steps[mode].append(clock() - t0)
        if mode != "none":
            stalls[mode].append(s)

    for mode in ("none", "async", "sync"):  # warm-up: first-touch of buffers, the writer thread
        step(mode)
    for k in steps:
        steps[k].clear()
    for k in stalls:
        stalls[k].clear()
    saved0, skipped0 = ck.stats.saved, ck.stats.skipped
    for _ in range(args.rounds):
        for mode in ("none", "async", "sync"):
            for _ in range(args.steps_per_round):
                step(mode)
        ck.flush()
    ck.close()
    state = _state_bytes(model, opt)
    buf = torch.empty(state // 4, dtype=torch.float32)
    src = torch.ones_like(buf)
    t0 = clock()
    buf.copy_(src)
    memcpy_s = clock() - t0
    step_s = median(steps["none"])
    a, s = median(stalls["async"]), median(stalls["sync"])
    return {"params": sum(p.numel() for p in model.parameters()), "state_bytes": state, "step_s": step_s,
            "async_stall_s": a, "sync_stall_s": s, "async_stall_share": a / step_s, "sync_stall_share": s / step_s,
            "sync_over_async_stall": s / a if a > 0 else float("inf"),
            "async_step_over_plain": median(steps["async"]) / step_s,
            "async_checkpointed": (ck.stats.saved - saved0) / max(1, len(stalls["async"])),
            "async_skipped": ck.stats.skipped - skipped0, "memcpy_floor_s": memcpy_s,
            "stalls_async": stalls["async"], "stalls_sync": stalls["sync"], "steps_plain": steps["none"]}


# ---------------------------------------------------------------------------------------------- rebuild

SERVER = r"""
import sys, time
from syncd.trainer.ft.replica_server import ReplicaServer
s = ReplicaServer(sys.argv[1], keep=2)
print(s.url, flush=True)
sys.stdin.readline()
s.close()
"""


def bench_rebuild(args, work: Path) -> dict:
    import torch

    from syncd.store import Store
    from syncd.trainer.ft.checkpoint import Checkpointer, parse_checkpoint, step_dir
    from syncd.trainer.ft.ckpt_format import MANIFEST, Bundle, parse_manifest
    from syncd.trainer.ft.replicas import fetch_checkpoint, push_replica

    torch.manual_seed(0)
    model = _mlp(args.rebuild_params, args.width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    model(torch.randn(2, args.width)).sum().backward()
    opt.step()
    own = work / "own"
    ck = Checkpointer(own, owner="rank-1", keep=1, on_busy="wait")
    ck.save(1, model, opt, wait=True)
    ck.close()
    src = step_dir(own, 1)
    total = sum(p.stat().st_size for p in src.iterdir())
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(work / "held")], cwd=ROOT, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        url = server.stdout.readline().strip()
        push_replica(url, src, owner="rank-1", step=1)
        store = Store.open(args.store or f"file://{work / 'store'}")
        for p in sorted(src.iterdir()):
            store.put(f"ckpt/rank-1/step-1/{p.name}", p.read_bytes())
        fresh = _mlp(args.rebuild_params, args.width)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-4, foreach=False)

        def from_peer() -> None:  # what FaultTolerance.restore does: fetched, verified, parsed in memory, loaded
            _, c = fetch_checkpoint(url, "rank-1", 1)
            c.apply(fresh, fresh_opt)

        def from_store() -> None:  # the same bundle from the store (parallel ranged reads), verified and parsed
            objs = {o.key.rsplit("/", 1)[1]: o.key for o in store.list("ckpt/rank-1/step-1/")}
            raw = bytes(store.download(objs.pop(MANIFEST)))
            m = parse_manifest(raw, where="object store", owner="rank-1", step=1)
            files = {}
            for name, ent in m["files"].items():
                buf = store.download(objs[name], expect_size=ent["bytes"])
                if hashlib.sha256(buf).hexdigest() != ent["sha256"]:
                    raise RuntimeError(f"object store: {name} does not match its manifest")
                files[name] = memoryview(buf)
            parse_checkpoint(Bundle(m, files, raw), "object store").apply(fresh, fresh_opt)

        peer, obj, ratios = paired_rounds(from_peer, from_store, args.rounds)
        same = all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    finally:
        server.stdin.close()
        server.wait(30)
    p, o = median(peer), median(obj)
    rate = total / p
    proj = _projection(rate, total / o)
    return {"params": sum(t.numel() for t in model.parameters()), "bytes": total, "peer_s": p, "store_s": o,
            "store_over_peer": median(ratios), "peer_bytes_per_s": rate, "store_bytes_per_s": total / o,
            "bit_exact": same, "projection_1t": proj, "store": args.store or "file:// (local disk)"}


def _projection(peer_rate: float, store_rate: float) -> dict:
    a = {"params": 1e12, "bytes_per_param": 16, "gpus": 16384, "gpus_per_node": 8,
         "why_bytes": "bf16 weights 2 + fp32 master 4 + AdamW m and v 8 + step/RNG/loop state ~2",
         "nic_bytes_per_s": 50e9, "nic": "one 400 Gb/s link per node (replicas come from k peers: k links)",
         "object_store_bytes_per_s": 2.5e9, "object_store": "per-node read rate from a cloud object store "
         "(~20 Gb/s, what one node gets from S3/GCS with many parallel ranged GETs)"}
    nodes = a["gpus"] // a["gpus_per_node"]
    shard = a["params"] * a["bytes_per_param"] / nodes
    return {"assumptions": a, "nodes": nodes, "shard_bytes_per_node": shard,
            "peer_s_at_measured_rate": shard / peer_rate, "peer_s_at_nic": shard / a["nic_bytes_per_s"],
            "store_s_at_measured_rate": shard / store_rate,
            "store_s_at_object_store_rate": shard / a["object_store_bytes_per_s"]}


# ---------------------------------------------------------------------------------------------- main


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.trainer_ft", description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--sections", default="stall,rebuild,goodput",
      help="comma-separated: stall, rebuild, goodput, outage, elastic")
    a("--stall-params", type=float, default=25e6, help="parameters of the stall benchmark's model")
    a("--rebuild-params", type=float, default=100e6, help="parameters of the rebuilt rank's model (AdamW state too)")
    a("--width", type=int, default=2048, help="hidden width of the MLPs")
    a("--batch", type=int, default=512, help="rows per training step (the stall benchmark)")
    a("--rounds", type=int, default=3, help="interleaved rounds (medians are over their samples)")
    a("--steps-per-round", type=int, default=4, help="training steps per mode per round (stall)")
    a("--store", default=None, help="object store URL for the rebuild baseline (default: file:// in the work folder)")
    a("--goodput-steps", type=int, default=40, help="steps of each goodput run")
    a("--fail-every", type=int, default=10, help="kill -9 the trainer every N steps (goodput)")
    a("--busy", choices=("wait", "skip"), default="wait",
      help="the trainer's --checkpoint-busy in the goodput runs (wait, its default: every step checkpointed; "
           "skip: no stall)")
    a("--outage-steps", type=int, default=16, help="steps of the outage run (killed at half)")
    a("--outage-s", type=float, default=15.0, help="seconds the trainer stays away (outage)")
    a("--outage-backlog", type=int, default=160, help="the rollout service's --max-backlog (outage; the default "
      "covers the default outage at this machine's generation rate)")
    a("--outage-hidden", type=int, default=64, help="hidden size of the outage run's model (1024 with 10 layers: "
      "about 100M parameters)")
    a("--outage-layers", type=int, default=2, help="layers of the outage run's model")
    a("--outage-replicas", type=int, default=0, help="the outage run's trainer as two ranks on two nodes, each "
      "checkpoint replicated to K holders (0: one rank, no replicas)")
    a("--outage-restart", choices=("standby", "cold"), default="standby", help="how the trainer comes back "
      "(outage): a warm standby started before the kill (--resume --standby, told by SIGUSR1) or a cold --resume")
    a("--elastic-steps", type=int, default=120, help="steps of each elastic run")
    a("--elastic-kill-at", type=int, default=8, help="the leading group is killed after this step (elastic)")
    a("--elastic-spare", action="store_true", help="restart the killed group from a warm spare, imports done "
      "(elastic; default: a cold start)")
    a("--workdir", default=None, help="keep the files here (default: a temporary folder)")
    output_flags(p, "trainer_ft")
    return p


def rows(out: dict) -> list[Row]:
    """The shared columns: the asynchronous checkpoint's stall against a synchronous torch.save, the rebuild from a
    peer against the object store (refcheck: the rebuilt state bit-exact), and goodput under failures (seconds per
    step) against the failure-free run."""
    table = []
    if "stall" in out:
        s = out["stall"]
        table.append(Row("async checkpoint stall", s["async_stall_s"], s["sync_over_async_stall"],
                         "torch.save + fsync", f"{s['params'] / 1e6:.1f}M params"))
    if "rebuild" in out:
        r = out["rebuild"]
        table.append(Row("rebuild from a peer replica", r["peer_s"], r["store_over_peer"], "from the object store",
                         f"{r['params'] / 1e6:.0f}M params + AdamW", refcheck=r["bit_exact"]))
    if "goodput" in out:
        g = out["goodput"]
        table.append(Row(f"kill -9 every {g['fail_every']} steps", 1 / g["goodput_failing"], g["goodput_ratio"],
                         "failure-free run", f"{g['steps']} steps"))
    if "outage" in out:
        o = out["outage"]
        table.append(Row("generation during a trainer outage", None, o["during_over_before"],
                         "before the outage (tokens/s)", f"{o['outage_s']:.0f} s away",
                         refcheck=o["prompts_lost"] == 0 and o["prompts_duplicated"] == 0))
    if "elastic" in out:
        e = out["elastic"]
        table.append(Row("leader killed, live side taken over", 1 / e["goodput_failing"], e["goodput_ratio"],
                         "failure-free run", f"{e['steps']} steps",
                         refcheck=(e["weights_equal"] or not e["rejoined"]) and e["prompts_duplicated"] == 0))
    return table


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    sections = [s for s in args.sections.split(",") if s]
    bad = [s for s in sections if s not in ("stall", "rebuild", "goodput", "outage", "elastic")]
    if bad or not sections:
        print(f"bench.trainer_ft: --sections: unknown {', '.join(bad) or '(none)'}; use stall, rebuild, goodput, "
              "outage, elastic", file=sys.stderr)
        return 2
    if not 1 <= args.elastic_kill_at < args.elastic_steps:
        print("bench.trainer_ft: --elastic-kill-at must be >= 1 and below --elastic-steps", file=sys.stderr)
        return 2
    if args.fail_every < 1 or args.goodput_steps <= args.fail_every:
        print("bench.trainer_ft: --fail-every must be >= 1 and below --goodput-steps", file=sys.stderr)
        return 2
    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="trainer-ft-")
    work = Path(args.workdir or tmp.name)
    out = {"bench": "trainer_ft", "host": platform.node(), "cpus": os.cpu_count(),
           "config": {k: v for k, v in vars(args).items() if k not in ("json", "plot", "workdir")}}
    try:
        for name, fn in (("stall", bench_stall), ("rebuild", bench_rebuild), ("goodput", bench_goodput),
                         ("outage", bench_outage), ("elastic", bench_elastic)):
            if name in sections:
                (work / name).mkdir(parents=True, exist_ok=True)
                out[name] = fn(args, work / name)
    finally:
        if tmp is not None:
            tmp.cleanup()
    _report(out)
    return finish("trainer_ft", args, out, rows(out), lambda path: plot(out, path))


def _report(out: dict) -> None:
    if "stall" in out:
        s = out["stall"]
        print(f"checkpoint stall per step ({s['params'] / 1e6:.1f}M params, {s['state_bytes'] / 2**20:.0f} MiB "
              f"of state, step {s['step_s'] * 1e3:.0f} ms): async {s['async_stall_s'] * 1e3:.2f} ms "
              f"({s['async_stall_share']:.2%} of the step), synchronous torch.save {s['sync_stall_s'] * 1e3:.0f} ms "
              f"({s['sync_stall_share']:.1%}); sync / async stall {s['sync_over_async_stall']:.0f}x; "
              f"non-overlapped snapshot floor (one memcpy) {s['memcpy_floor_s'] * 1e3:.1f} ms")
        print(f"  async: step wall {s['async_step_over_plain']:.2f}x the plain step (the writer shares the cores); "
              f"{s['async_checkpointed']:.0%} of steps checkpointed, {s['async_skipped']} skipped (writer busy)")
    if "rebuild" in out:
        r = out["rebuild"]
        print(f"rebuild of a dead rank ({r['params'] / 1e6:.0f}M params + AdamW, {r['bytes'] / 2**30:.2f} GiB, "
              f"verified and loaded): from a peer's replica {r['peer_s']:.2f} s ({r['peer_bytes_per_s'] / 1e9:.2f} "
              f"GB/s), from the object store [{r['store']}] {r['store_s']:.2f} s; store / peer "
              f"{r['store_over_peer']:.2f}x; bit-exact {r['bit_exact']}")
        p = r["projection_1t"]
        a = p["assumptions"]
        print(f"  1T projection: {a['params']:.0e} params x {a['bytes_per_param']} B ({a['why_bytes']}) over "
              f"{p['nodes']} nodes ({a['gpus']} GPUs / {a['gpus_per_node']}) = {p['shard_bytes_per_node'] / 1e9:.1f} "
              f"GB per node; from peers {p['peer_s_at_measured_rate']:.1f} s at the rate measured here, "
              f"{p['peer_s_at_nic']:.2f} s at {a['nic']} ({a['nic_bytes_per_s'] / 1e9:.0f} GB/s); from the store "
              f"{p['store_s_at_object_store_rate']:.1f} s at {a['object_store_bytes_per_s'] / 1e9:.1f} GB/s "
              f"({a['object_store']})")
    if "goodput" in out:
        g = out["goodput"]
        print(f"goodput ({g['steps']} steps, kill -9 of the whole trainer every {g['fail_every']} steps, "
              f"--checkpoint-busy {g['busy']}, "
              f"{g['failures']} failures): steps lost per failure {g['steps_lost_per_failure']:.2f} {g['steps_lost']}; "
              f"{g['goodput_failing']:.3f} steps/s against {g['goodput_plain']:.3f} failure-free "
              f"({g['goodput_ratio']:.2f}x); restart to resumed {g['restart_to_resumed_s']:.1f} s (process start)")
        if g.get("plain_checkpoint_stall_s") is not None:
            print(f"  failure-free run: {g['plain_checkpoints_saved']} checkpoints per rank, "
                  f"{g['plain_checkpoints_skipped']} skipped; checkpoint stall {g['plain_checkpoint_stall_s']:.2f} s = "
                  f"{g['plain_checkpoint_stall_s'] / g['plain_wall_s']:.1%} of its wall time (process start included)")
    if "outage" in out:
        o = out["outage"]
        print(f"outage ({o['params'] / 1e6:.1f}M params, {o['replicas']} replica(s) on peers, {o['steps']} steps, "
              f"the trainer killed after step {o['killed_after_step']} and away "
              f"{o['outage_s']:.0f} s, the service's backlog {o['backlog']} groups): generation "
              f"{o['gen_tokens_per_s_during']:.1f} tokens/s during against {o['gen_tokens_per_s_before']:.1f} before "
              f"({o['during_over_before']:.2f}x; goal >= 0.8); restart ({o['restart']}) to first step "
              f"{o['restart_to_first_step_s']:.1f} s (restored after {o['restart_to_restore_s']:.1f} s); prompts lost "
              f"{o['prompts_lost']}, duplicated "
              f"{o['prompts_duplicated']}; {o['groups_written']} groups written, {o['groups_trained']} trained, "
              f"{o['groups_sent_back']} sent back (stale after the outage, or refused); task mix after the restart "
              f"{o['task_mix']['after']} against {o['task_mix']['before']} before, p = {o['task_mix_p_value']:.3f} "
              "(goal >= 0.01)")
    if "elastic" in out:
        e = out["elastic"]
        fmt = lambda x: "n/a" if x is None else f"{x:.1f} s"  # noqa: E731
        print(f"elastic ({e['steps']} steps, 2 replica groups, the leader killed after step {e['killed_after_step']}"
              f", {e['restart']}): shrink {fmt(e['shrink_s'])}, takeover {fmt(e['takeover_s'])} (leader timeout "
              f"{e['leader_timeout_s']:.0f} s), regrow {fmt(e['regrow_s'])} (rejoined {e['rejoined']}); goodput {e['goodput_failing']:.2f} "
              f"against {e['goodput_plain']:.2f} steps/s failure-free ({e['goodput_ratio']:.2f}x); prompts "
              f"duplicated {e['prompts_duplicated']}, weights equal {e['weights_equal']}")


def plot(out: dict, path: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(1, 3, figsize=(15, 4.5))
    if "stall" in out:
        s = out["stall"]
        ax[0].boxplot([[x * 1e3 for x in s["stalls_async"]], [x * 1e3 for x in s["stalls_sync"]],
                       [x * 1e3 for x in s["steps_plain"]]], tick_labels=["async stall", "torch.save stall", "step"])
        ax[0].set(yscale="log", ylabel="ms", title="checkpoint stall per step")
    if "rebuild" in out:
        r = out["rebuild"]
        ax[1].bar(["peer replica", "object store"], [r["peer_s"], r["store_s"]], color=["tab:green", "tab:gray"])
        ax[1].set(ylabel="s", title=f"rebuild {r['params'] / 1e6:.0f}M params + AdamW")
    if "goodput" in out:
        g = out["goodput"]
        ax[2].bar(["failure-free", f"kill every {g['fail_every']}"], [g["goodput_plain"], g["goodput_failing"]],
                  color=["tab:blue", "tab:red"])
        ax[2].set(ylabel="steps / s", title=f"goodput, {g['steps_lost_per_failure']:.1f} steps lost per failure")
    save(fig, path, dpi=90)


if __name__ == "__main__":
    sys.exit(main())
