"""The thin trainer's RL loop, measured: the asynchronous loop against a synchronous baseline, side by side.

Each mode gets a fresh serving side (``syncd.app.rl_stack``: two reference-engine workers under the Dynamo frontend
recording replay records, the sandbox proxy, the node daemon) and one ``python -m syncd.trainer.run`` with the same
task, sizes, seed and step count:

* **async** (``async:ETA``, one run per staleness bound asked for): rollout workers run ahead of training
  (look-ahead two steps of groups), a version every ``--every-k`` steps, the daemon applying it while the
  engines generate; groups with a token more than eta versions behind are dropped;
* **sync**: generate a step's groups on the newest version (once the daemon says every engine serves it), then
  train, then publish and wait for the engines: what an RL loop without weight sync in the background does.

Figures (JSON; ``--plot`` draws them; with ``--repeats N`` the modes run N times interleaved and every scalar is
the median of its N values, the curves those of the first repeat): reward versus step and versus wall time, final
reward (mean of the last ``--window`` steps), trained tokens per second of wall time, the trainer's own tokens per
second, the staleness distribution of trained tokens (versions behind), the median time from ``publish()`` to every
engine serving that version, and the share of generated groups dropped as stale. Next to them, measured on the
first mode's stack before its run: the **generation ceiling**, tokens per second the engines produce for one step's
requests sent at once through the proxy (median of 3), which bounds trained tokens per second from above whatever
the loop does. On two cores trainer and engines share the CPU, so the overlap async buys is small and the
look-ahead wastes some generation; the report says what it measured.

    python -m bench.rl_loop                       # async eta 1 and 2, sync: 40 steps x 4 groups x 8, 2 ranks
    python -m bench.rl_loop --modes async:1,sync --steps 80 --json rl.json --plot rl.png
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench._plot import pyplot, save
from bench._report import Row, finish, output_flags
from bench._timing import Stopwatch

ROOT = Path(__file__).resolve().parents[1]


def _generation_ceiling(stack, requests: int, tokens: int, repeats: int = 3) -> float:
    """Tokens per second of ``requests`` completions of ``tokens`` tokens sent at once through the proxy."""
    from syncd.trainer.rl.rollout_workers import complete, proxy_models

    body = {"model": proxy_models(stack.proxy_url)[0], "prompt": "a:", "max_tokens": tokens, "ignore_eos": True,
            "temperature": 1.0}
    rates = []
    with cf.ThreadPoolExecutor(requests) as pool:
        for r in range(repeats):
            t0 = Stopwatch()
            list(pool.map(lambda i: complete(stack.proxy_url, {**body, "seed": i}, f"ceiling-{r}-{i}"),
                          range(requests)))
            rates.append(requests * tokens / (t0.elapsed))
    return statistics.median(rates)


def _modes(text: str) -> list[tuple[str, str, int]]:
    """``(name, kind, eta)`` per mode of ``--modes`` (``async:ETA`` or ``sync``); ValueError otherwise."""
    out = []
    for m in filter(None, text.split(",")):
        kind, _, eta = m.partition(":")
        if kind == "sync" and not eta:
            out.append(("sync", "sync", 0))
        elif kind == "async" and eta.isdigit():
            out.append((f"async-eta{eta}", "async", int(eta)))
        else:
            raise ValueError(f"--modes: {m!r} is neither async:ETA nor sync")
    if not out:
        raise ValueError("--modes: no mode given")
    return out


def run_mode(name: str, kind: str, eta: int, args, workdir: Path, *, ceiling: bool) -> dict:
    from syncd.app.rl_stack import RLStack, StackConfig
    from syncd.trainer.rl.metrics import publish_to_serving, read_metrics, summarize

    mode = name
    stack = RLStack(StackConfig(workdir / mode, run_id=f"rl-{mode}", engines=args.engines, seed=args.seed)).start()
    try:
        ceiling = _generation_ceiling(stack, args.groups_per_step * args.group_size, args.task_length) \
            if ceiling else None
        flags = ["--out", str(workdir / mode / "out"), "--steps", str(args.steps), "--nproc", str(args.nproc),
                 "--groups-per-step", str(args.groups_per_step), "--group-size", str(args.group_size),
                 "--every-k", str(args.every_k), "--max-lag", str(eta), "--task", args.task,
                 "--task-length", str(args.task_length), "--seed", str(args.seed), "--lr", str(args.lr),
                 "--top-p", str(args.top_p), "--no-plot", *(["--sync"] if kind == "sync" else [])]
        t0 = Stopwatch()
        p = subprocess.run(stack.trainer_argv(*flags), env=stack.env, cwd=ROOT, capture_output=True, text=True,
                           timeout=args.timeout)
        if p.returncode != 0:
            raise RuntimeError(f"{mode}: syncd.trainer.run exited {p.returncode}: {p.stderr[-3000:]}")
        process_s = t0.elapsed
        lines = read_metrics(workdir / mode / "out" / "metrics.jsonl")
    finally:
        stack.close()
    s = summarize(lines, window=args.window)
    steps = [ln for ln in lines if ln["kind"] == "step"]
    t_start = next(ln["t"] for ln in lines if ln["kind"] == "start")
    end = next(ln for ln in lines if ln["kind"] == "end")
    made = end.get("rollouts", {}).get("groups", 0)
    serve = [x["seconds"] for x in publish_to_serving(lines) if x["seconds"] is not None and x["version"] > 0]
    return {"mode": mode, "kind": kind, "max_lag": eta, "steps": len(steps), "final_reward": s["reward_last"],
            "first_reward": s["reward_first"],
            "reward_by_step": [x["reward_mean"] for x in steps],
            "reward_by_time": [[x["t"] - t_start, x["reward_mean"]] for x in steps],
            "loop_wall_s": s["wall_s"], "process_wall_s": process_s, "tokens_trained": s["tokens_trained"],
            "trained_tokens_per_s": s["trained_tokens_per_s"], "trainer_tokens_per_s": s["trainer_tokens_per_s"],
            "staleness_counts": s["staleness_counts"], "staleness_mean": s["staleness_mean"],
            "publish_to_serving_s_median": statistics.median(serve) if serve else None,
            "publish_to_serving_s": serve, "groups_generated": made, "groups_dropped_stale": s["dropped_stale"],
            "wasted_share": s["dropped_stale"] / made if made else None, "rollout_failures": s["rollout_failures"],
            "is_outside_median": s["is_outside_median"], "kl_k3_median": s["kl_k3_median"],
            "generation_ceiling_tokens_per_s": ceiling,
            "engine_versions": [[ln["t"] - t_start, ln["engine"], ln["version"]] for ln in lines
                                if ln["kind"] == "engine"],
            "publishes": [[ln["t"] - t_start, ln["version"]] for ln in lines if ln["kind"] == "publish"]}


SCALARS = ("final_reward", "first_reward", "loop_wall_s", "process_wall_s", "trained_tokens_per_s",
           "trainer_tokens_per_s", "staleness_mean", "publish_to_serving_s_median", "wasted_share",
           "is_outside_median", "kl_k3_median", "generation_ceiling_tokens_per_s")


def _median_of(runs: list[dict]) -> dict:
    """The first run's curves and distributions, each scalar the median over ``runs`` (each repeat's in
    ``repeats``)."""
    out = dict(runs[0])
    for k in SCALARS:
        vals = [r[k] for r in runs if r.get(k) is not None]
        out[k] = statistics.median(vals) if vals else None
    out["repeats"] = [{k: r.get(k) for k in SCALARS} for r in runs]
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.rl_loop", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--groups-per-step", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--nproc", type=int, default=2, help="data-parallel trainer ranks")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--every-k", type=int, default=1)
    p.add_argument("--task", default="repeat")
    p.add_argument("--task-length", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--window", type=int, default=5, help="steps averaged for the final reward")
    p.add_argument("--modes", default="async:1,async:2,sync",
                   help="comma-separated async:ETA (staleness bound) or sync, run in this order")
    p.add_argument("--repeats", type=int, default=1, help="runs of every mode, interleaved; figures are medians")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per trainer run")
    p.add_argument("--workdir", default=None, help="keep the runs here (default: a temporary folder)")
    output_flags(p, "rl_loop")
    return p


def rows(out: dict) -> list[Row]:
    """The shared columns: every mode's loop wall time, the asynchronous ones against the synchronous loop (ratio:
    trained tokens per second over the synchronous loop's)."""
    c = out["config"]
    sizes = f"{c['steps']} steps x {c['groups_per_step']}x{c['group_size']}"
    return [Row(f"{name} loop", r["loop_wall_s"], r.get("over_sync_trained_tokens_per_s"),
                "synchronous loop" if "over_sync_trained_tokens_per_s" in r else "", sizes)
            for name, r in out["runs"].items()]


def _fmt(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        modes = _modes(args.modes)
    except ValueError as exc:
        print(f"bench.rl_loop: {exc}", file=sys.stderr)
        return 2
    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="rl-loop-")
    workdir = Path(args.workdir or tmp.name)
    try:
        reps = [{name: run_mode(name, kind, eta, args, workdir / f"r{r}", ceiling=i == 0)
                 for i, (name, kind, eta) in enumerate(modes)} for r in range(args.repeats)]
        runs = {name: _median_of([rp[name] for rp in reps]) for name, _, _ in modes}
    finally:
        if tmp is not None:
            tmp.cleanup()
    out = {"bench": "rl_loop", "host": platform.node(), "cpus": __import__("os").cpu_count(),
           "config": {k: v for k, v in vars(args).items() if k not in ("json", "plot", "workdir")}, "runs": runs}
    if "sync" in runs:
        s = runs["sync"]
        for name, a in runs.items():
            if a["kind"] == "async":
                a["over_sync_trained_tokens_per_s"] = a["trained_tokens_per_s"] / s["trained_tokens_per_s"]
                a["minus_sync_final_reward"] = a["final_reward"] - s["final_reward"]
    print(f"{'':34}" + "".join(f"{m:>12}" for m in runs))  # the ceiling: measured on the first mode's stack
    for label, key, spec in (("final reward (last steps)", "final_reward", ".3f"),
                             ("first reward", "first_reward", ".3f"),
                             ("trained tokens/s (wall)", "trained_tokens_per_s", ".0f"),
                             ("trainer tokens/s (compute)", "trainer_tokens_per_s", ".0f"),
                             ("loop wall time (s)", "loop_wall_s", ".1f"),
                             ("staleness mean (versions)", "staleness_mean", ".2f"),
                             ("publish -> all engines (s, med)", "publish_to_serving_s_median", ".3f"),
                             ("groups dropped stale / made", "wasted_share", ".2f"),
                             ("generation ceiling tokens/s", "generation_ceiling_tokens_per_s", ".0f")):
        print(f"{label:34}" + "".join(f"{_fmt(r[key], spec):>12}" for r in runs.values()))
    for m, r in runs.items():
        print(f"{m}: staleness of trained tokens {r['staleness_counts']}")
    for m, r in runs.items():
        if "over_sync_trained_tokens_per_s" in r:
            print(f"{m} / sync trained tokens per second: {r['over_sync_trained_tokens_per_s']:.2f}x; "
                  f"final reward {m} - sync: {r['minus_sync_final_reward']:+.3f}")
    return finish("rl_loop", args, out, rows(out), lambda path: plot(out, path))


def plot(out: dict, path: Path) -> None:
    plt = pyplot()

    runs = out["runs"]
    fig, ax = plt.subplots(2, 2, figsize=(11, 8))
    for m, r in runs.items():
        ax[0, 0].plot(range(1, len(r["reward_by_step"]) + 1), r["reward_by_step"], marker=".", label=m)
        t, v = zip(*r["reward_by_time"]) if r["reward_by_time"] else ((), ())
        ax[0, 1].plot(t, v, marker=".", label=m)
    ax[0, 0].set(xlabel="step", ylabel="reward (mean)", title="reward vs step")
    ax[0, 1].set(xlabel="wall time (s)", ylabel="reward (mean)", title="reward vs wall time")
    for m, r in runs.items():
        lags = sorted(r["staleness_counts"].items(), key=lambda kv: int(kv[0]))
        total = sum(c for _, c in lags) or 1
        shift = (list(runs).index(m) - (len(runs) - 1) / 2) * 0.8 / len(runs)
        ax[1, 0].bar([int(k) + shift for k, _ in lags], [c / total for _, c in lags], width=0.8 / len(runs), label=m)
    ax[1, 0].set(xlabel="versions behind", ylabel="share of trained tokens", title="staleness of trained tokens")
    r = next((x for x in runs.values() if x["kind"] == "async"), next(iter(runs.values())))
    if r["publishes"]:
        t, v = zip(*r["publishes"])
        ax[1, 1].step(t, v, where="post", label="trainer (publish)", linewidth=2)
    for name in sorted({e[1] for e in r["engine_versions"]}):
        ev = [e for e in r["engine_versions"] if e[1] == name]
        ax[1, 1].step([e[0] for e in ev], [e[2] for e in ev], where="post", linestyle="--", label=f"engine {name}")
    ax[1, 1].set(xlabel="wall time (s)", ylabel="version", title=f"versions over time ({r['mode']})")
    for a in ax.flat:
        a.legend(fontsize=8)
    save(fig, path, dpi=90)


if __name__ == "__main__":
    sys.exit(main())
