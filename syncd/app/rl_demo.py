"""``syncd demo``: an asynchronous RL run that learns, end to end on this machine, in about a minute.

The serving side (``syncd.app.rl_stack``): a tiny random-init model, two reference-engine workers under the NVIDIA
Dynamo frontend (recording replay records), the sandbox proxy (recording trajectories) and the ``syncd`` node
daemon. The rollout service (``syncd rollouts``, its own process) sends each prompt of the ``repeat`` task 8 times
through the proxy, scores the answers and writes each group to the run's queue in the store; the trainer (``python -m
syncd.trainer.run --external-rollouts``, two data-parallel ranks) reads the queue, reads trajectories and replay
records back from the store, takes a replay-corrected policy-gradient step and publishes a version every step; the
daemon applies it to both engines in place while they keep generating. Progress shows the step, the reward, the
staleness and each engine's version; the summary gives the reward before and after, versions published and
applied, pauses, staleness and the trainer/engine mismatch, and is written as JSON with ``--json``. Exit status 0
only when no rollout was lost (every request answered, every record complete) and every engine ended bit-exact
(whole fp32 words) on the trainer's last version.

Files: everything goes into the work directory (``--dir``, or a temporary one that is removed at the end but for the
pictures): the store, signed with an Ed25519 key pair made next to it (``signing.key``, ``signing.pub``; with
``--keep``/``--dir`` the demo prints how to read the store with ``syncd ls/verify/materialize``), logs, the
trainer's output and the pictures (``syncd-demo.png``, ``syncd-demo-trainer.png``). An output a flag names that
cannot be written is refused before the run (exit 2). Ctrl-C (once or more, at any point) stops every process the
demo started and exits 130 (:mod:`syncd.app.interrupts`).

With ``--engine vllm`` one vLLM worker (the ``vllm`` extra; a tiny model with head_dim 64, as vLLM's CPU attention
needs) serves and records instead: kept sets by construction in syncd's logits processor, vLLM's processed
log-probs for the importance correction. Its weights check covers vLLM's own parameters, the fused ones
(``qkv_proj``, ``gate_up_proj``) against the same fusion of the materialized version; the demo prints what it compared.
``--moe``: a tiny Qwen3-MoE instead, whose records carry every token's routes for the trainer to replay.

    syncd demo [--steps 60] [--engine reference|vllm] [--moe] [--json PATH] [--plot PNG] [--dir DIR] [--keep]
               [--plain]
    syncd demo --weights-only [...]     the weight-sync demo (syncd.app.demo: a supervised trainer, a client)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from syncd.app.demo_io import (add_common_flags, delta_sizes, finish_work_dir, how_to_read, plot_timeline,
                               published_versions, run_demo, say)
from syncd.app.interrupts import Interrupts
from syncd.cli_help import HelpFormatter

__all__ = ["main", "build_parser", "run"]

ROOT = Path(__file__).resolve().parents[1]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="syncd demo", description=__doc__.split("\n\n")[0].replace("``", ""),
                                formatter_class=HelpFormatter,
                                epilog="syncd demo --weights-only --help: the weight-sync demo's flags")
    p.add_argument("--weights-only", action="store_true", help="run the weight-sync demo (syncd.app.demo) instead")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps (a version each)")
    p.add_argument("--nproc", type=int, default=2, help="data-parallel trainer ranks")
    p.add_argument("--engine", choices=("reference", "vllm"), default="reference",
                   help="the engine the workers run: syncd's CPU reference engine, or vLLM (the vllm extra; its "
                        "records come from syncd's logits processor and recorder inside vLLM)")
    p.add_argument("--moe", action="store_true",
                   help="a tiny mixture-of-experts model (Qwen3-MoE, 8 experts, top-2): the engines record every "
                        "token's routes and the trainer replays them (its metrics' routing_disagreement)")
    p.add_argument("--workers", type=int, default=None,
                   help="engine workers under the Dynamo frontend (default: 2 reference engines, 1 vLLM engine)")
    p.add_argument("--task", default="repeat", help="syncd.trainer.rl.tasks task the policy learns")
    p.add_argument("--every-k", type=int, default=1, help="publish a version every K steps")
    p.add_argument("--max-lag", type=int, default=2, help="staleness bound eta: versions a trained token may lag")
    p.add_argument("--top-p", type=float, default=0.95, help="the engines sample from the top-p kept set")
    p.add_argument("--lr", type=float, default=1e-2,
                   help="learning rate: high, so that a tiny model learns in a minute (real RL runs use ~1e-6; the "
                        "delta's size follows it)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model's random init and of the trainer")
    add_common_flags(p, plot="the timeline (trainer's and engines' versions over time, pauses); the trainer's own "
                             "picture (reward, mismatch) goes next to it as <name>-trainer.png; '' for none (default: "
                             "syncd-demo.png in the work directory)",
                     pictures="pictures", kept="logs, store and its signing keys, metrics", timeout=600)
    return p


def _progress_line(step_line: dict | None, steps: int, engines: dict) -> str:
    if step_line is None:
        return "[demo] waiting for the first step"
    s = step_line
    engs = " ".join(f"{n} v{e.get('version')}" for n, e in sorted(engines.items()))
    return (f"[demo] step {s['step']}/{steps} reward {s['reward_mean']:.3f} | trainer v{s.get('published_version')}"
            f" | {engs} | staleness {s.get('staleness_mean') or 0:.2f} | IS mean {s.get('is_mean') or 0:.3f}")


def _watch(proc: subprocess.Popen, metrics: Path, stack, args, display) -> None:
    from syncd.trainer.rl.metrics import read_metrics

    t0 = time.monotonic()
    deadline = t0 + args.timeout
    last_line, last_print = None, 0.0
    while proc.poll() is None:
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"demo: timed out after {args.timeout:.0f} s")
        dead = stack.dead()
        if dead:
            proc.kill()
            raise RuntimeError(f"demo: {dead}")
        lines = read_metrics(metrics) if metrics.exists() else []
        step = next((ln for ln in reversed(lines) if ln["kind"] == "step"), None)
        engines = stack.daemon_status().get("engines", {})
        line = _progress_line(step, args.steps, engines)
        if display is not None:
            display.update(display.task_ids[0], completed=step["step"] if step else 0, info=line[7:])
        elif step is None:
            if last_line is None or time.monotonic() - last_print > 15:
                waited = time.monotonic() - t0
                print(line + (" (the trainer loads the model and collects the first rollouts)" if last_line is None
                              else f" ({waited:.0f} s)"), flush=True)
                last_line, last_print = line, time.monotonic()
        elif line != last_line and time.monotonic() - last_print > 2.0:
            print(line, flush=True)
            last_line, last_print = line, time.monotonic()
        time.sleep(0.25)


def run(args, work: Path, interrupts: Interrupts) -> dict:
    """Run the demo in ``work`` (see the module docstring); returns the summary. RuntimeError when a part fails;
    KeyboardInterrupt (after stopping what it started) when ``interrupts`` says so."""
    kept = bool(args.dir or args.keep)
    every = "a version per step" if args.every_k == 1 else f"a version every {args.every_k} steps"
    say(f"an RL run on this machine: the thin trainer ({args.nproc} ranks, {args.steps} steps, {every}), "
        f"{args.workers} {args.engine} engine{'s' if args.workers > 1 else ''} under Dynamo, the sandbox proxy and "
        f"the syncd daemon; work dir "
        f"{work}{'' if kept else ' (removed at the end but for the pictures; --keep keeps it)'}")
    from syncd.app.rl_stack import RLStack, StackConfig

    t0 = time.time()
    stack = RLStack(StackConfig(work, engines=args.workers, engine=args.engine, seed=args.seed,
                                arch="qwen3_moe" if args.moe else "qwen2",
                                startup_timeout_s=420.0 if args.engine == "vllm" else 240.0))
    trainer: list[subprocess.Popen] = []
    interrupts.watch(stack.processes)
    interrupts.watch(lambda: trainer)
    display, pictures = None, {}
    try:
        stack.start(say=say)
        out = work / "trainer"
        task = ("--task", args.task, "--top-p", str(args.top_p), "--seed", str(args.seed))
        argv = stack.trainer_argv("--out", str(out), "--nproc", str(args.nproc), "--steps", str(args.steps),
                                  "--every-k", str(args.every_k), "--max-lag", str(args.max_lag), *task,
                                  "--lr", str(args.lr), "--delta-format", str(args.delta_format),
                                  external_rollouts=True)
        say(f"engines serving version 0 after {time.time() - t0:.0f} s; starting the trainer and the rollout service "
            "(syncd rollouts, its own process)")
        with open(stack.logs / "rollouts.log", "wb") as err:  # the rollout service: prompts, rewards, the queue
            trainer.append(subprocess.Popen(stack.rollouts_argv(*task), env=stack.env, cwd=ROOT,
                                            stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL,
                                            start_new_session=True))
        with open(stack.logs / "trainer.log", "wb") as err:  # its own process group: its ranks stop with it
            trainer.append(subprocess.Popen(argv, env=stack.env, cwd=ROOT, stdout=subprocess.PIPE, stderr=err,
                                            stdin=subprocess.DEVNULL, start_new_session=True))
        service, proc = trainer
        if not args.plain and sys.stdout.isatty():
            try:
                from rich.progress import BarColumn, Progress, TextColumn

                display = Progress(TextColumn("RL steps"), BarColumn(), TextColumn("{task.fields[info]}"))
                display.add_task("steps", total=args.steps, info="starting")
                display.start()
            except ImportError:
                display = None
        _watch(proc, out / "metrics.jsonl", stack, args, display)
        if display is not None:
            display.stop()
            display = None
        reply = proc.stdout.read().decode(errors="replace").strip().splitlines()
        if proc.returncode != 0 or not reply:
            raise RuntimeError(f"demo: the trainer exited with status {proc.returncode}: "
                               f"{stack.log_tail('trainer', 3000)}")
        trained = json.loads(reply[-1])
        trained["rollouts"] = _service_stats(service, stack)  # the requests and failures are the service's
        final = trained["final_version"]
        say(f"the trainer is done; waiting for every engine to serve version {final}, then checking their weights "
            "against its manifest")
        stack.wait_engines_at(final, timeout_s=120)
        exact = stack.engines_bit_exact(final)
        for name, what in stack.checked.items():
            say(f"{name}: checksums compared for {what}")
        proxy = stack.proxy_health()
        stack.stop_daemon()
        status = stack.daemon_status()
        versions = published_versions(stack.store_url, stack.run_id, stack.verify_key)
        pictures = _pictures(args, work, versions, status.get("updates", []), out / "run.png")
        say("stopping the engines and the proxy (they write their last records)")
        if kept:
            say(how_to_read(work / "store", stack.run_id, stack.public_key_file, stack.private_key_file))
        return summarize(args, trained, status, exact, proxy, time.time() - t0, work, versions, pictures,
                         stack.checked)
    finally:
        try:
            if display is not None:
                display.stop()
            for p in trainer:
                _stop_group(p)
            stack.close()
        finally:
            finish_work_dir(work, kept, [v for k, v in pictures.items() if k.endswith("_png")])


def _service_stats(service: subprocess.Popen, stack) -> dict:
    """Stop the rollout service (SIGTERM) and return its rollout workers' stats from its last line."""
    from syncd.procs import stop_process

    code = stop_process(service, 30)
    lines = service.stdout.read().decode(errors="replace").strip().splitlines()
    if code != 0 or not lines:
        raise RuntimeError(f"demo: the rollout service exited with status {code}: {stack.log_tail('rollouts', 3000)}")
    return json.loads(lines[-1]).get("workers") or {}


def _stop_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM ``proc`` (it leads its own process group), then SIGKILL what is left of its group."""
    from syncd.procs import stop_process

    stop_process(proc, grace_s)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _pictures(args, work: Path, versions: list, updates: list, trainer_png: Path) -> dict:
    """The timeline at ``--plot`` (default: ``syncd-demo.png`` in ``work``) and the trainer's picture next to it;
    their paths (None: not drawn, and why)."""
    if args.plot == "":
        return {}
    path = Path(args.plot).resolve() if args.plot else work / "syncd-demo.png"
    try:
        timeline = plot_timeline(versions, updates, path, title="syncd demo: versions over time")
    except ImportError as exc:
        return {"plot_error": str(exc)}
    out = {"timeline_png": str(timeline)}
    if trainer_png.exists():
        dest = timeline.with_name(timeline.stem + "-trainer.png")
        shutil.copyfile(trainer_png, dest)
        out["trainer_png"] = str(dest)
    return out


def summarize(args, trained: dict, status: dict, exact: dict, proxy: dict, wall_s: float, work: Path,
              versions: list | None = None, pictures: dict | None = None, checked: dict | None = None) -> dict:
    """The demo's summary. Lost: rollout failures the trainer counted (requests, records, replay records, rewards)
    plus the proxy's failure counts (``/health``) and records it still has pending."""
    updates = [u for u in status.get("updates", []) if u.get("rebuild_from") is None]
    pauses = [p for u in updates for p in u["pause_s"].values()]
    rollouts = trained.get("rollouts") or {}
    failures = {f"trainer/{k}": v for k, v in (rollouts.get("failures") or {}).items()}
    failures.update({f"proxy/{k}": v for k, v in (proxy.get("failures") or {}).items()})
    failures["proxy/pending_writes"] = int(proxy.get("pending_writes") or 0)
    return {
        "steps": trained.get("steps"), "reward_before": trained.get("reward_first"),
        "reward_after": trained.get("reward_last"), "reward_window": trained.get("reward_window"),
        "versions_published": trained.get("versions_published"), "final_version": trained.get("final_version"),
        "versions_applied": len({u["version"] for u in updates}), "engine": args.engine, "engines": len(exact),
        "engines_bit_exact": bool(exact) and all(exact.values()), "engine_bit_exact": exact,
        "engine_weights_checked": checked or {},
        "pause_s_median": statistics.median(pauses) if pauses else None, "pause_s_max": max(pauses, default=None),
        "publish_to_serving_s_median": trained.get("publish_to_serving_s_median"),
        "staleness_mean": trained.get("staleness_mean"), "staleness_max": trained.get("staleness_max"),
        "staleness_counts": trained.get("staleness_counts"), "is_mean_median": trained.get("is_mean_median"),
        "is_outside_median": trained.get("is_outside_median"), "kl_k3_median": trained.get("kl_k3_median"),
        "tokens_trained": trained.get("tokens_trained"), "trained_tokens_per_s": trained.get("trained_tokens_per_s"),
        "rollout_requests": rollouts.get("requests"), "groups_dropped_stale": trained.get("dropped_stale"),
        "rollouts_lost": sum(failures.values()), "rollout_failures": failures,
        "ranks_agree": trained.get("ranks_agree"),
        **delta_sizes(versions or []), "delta_format": args.delta_format, "lr": args.lr, "every_k": args.every_k,
        "wall_s": wall_s, "workdir": str(work) if (args.dir or args.keep) else None, **(pictures or {}),
    }


def print_summary(s: dict) -> None:
    def f(x, spec):
        return "-" if x is None else format(x, spec)

    applied = s["versions_applied"]
    rows = [("reward before -> after", f"{f(s['reward_before'], '.3f')} -> {f(s['reward_after'], '.3f')} "
                                        f"(mean of {s['reward_window']} steps)"),
            ("steps / versions published / applied",
             f"{s['steps']} / {s['versions_published']} (v0 full, then one per {args_k(s)}) / {applied} (the "
             "engines started on v0)"),
            ("engines bit-exact on the last version", f"{s['engines_bit_exact']} (version {s['final_version']}, "
                                                       f"{s.get('engines')} {s.get('engine', 'reference')} engine(s))"),
            ("rollout requests / lost", f"{s['rollout_requests']} / {s['rollouts_lost']}"),
            ("pause median / max", f"{f(s['pause_s_median'] and s['pause_s_median'] * 1e3, '.1f')} / "
                                   f"{f(s['pause_s_max'] and s['pause_s_max'] * 1e3, '.1f')} ms"),
            ("publish -> every engine (median)", f"{f(s['publish_to_serving_s_median'], '.3f')} s"),
            ("delta per version (median)", _delta_text(s)),
            ("staleness of trained tokens", f"mean {f(s['staleness_mean'], '.2f')}, max {s['staleness_max']}, "
             + ", ".join(f"{n} at {k}" for k, n in (s['staleness_counts'] or {}).items())),
            ("groups dropped as stale", str(s["groups_dropped_stale"])),
            ("IS ratio mean / share outside [0.9, 1.1]", f"{f(s['is_mean_median'], '.4f')} / "
                                                         f"{f(s['is_outside_median'], '.1%')} (median over steps)"),
            ("mismatch KL k3 (median over steps)", f(s["kl_k3_median"], ".2e")),
            ("trained tokens / per second", f"{s['tokens_trained']:,} / {f(s['trained_tokens_per_s'], ',.0f')}"),
            ("wall time", f"{s['wall_s']:.1f} s")]
    if s.get("timeline_png"):
        rows.append(("timeline", s["timeline_png"] + (f" (trainer: {s['trainer_png']})" if s.get("trainer_png")
                                                      else "")))
    elif s.get("plot_error"):
        rows.append(("timeline", f"not drawn: {s['plot_error']}"))
    if s.get("workdir"):
        rows.append(("work dir (kept)", f"{s['workdir']} (logs/, store/, trainer/metrics.jsonl)"))
    width = max(len(k) for k, _ in rows)
    print("syncd demo summary (RL)")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    if s.get("delta_fraction_median") is not None and s["delta_fraction_median"] > 0.05:
        print(f"  (About the delta size: this demo trains a tiny random-init model at lr {f(s.get('lr'), 'g')} so "
              "that it learns within a minute, and at that rate nearly every weight changes every step. The "
              "README's ~1% is what real RL settings give: a 100M model at lr 1e-6, `python -m bench.codec`.)")


def args_k(s: dict) -> str:
    return "step" if s.get("every_k", 1) == 1 else f"{s['every_k']} steps"


def _delta_text(s: dict) -> str:
    if s.get("delta_bytes_median") is None:
        return "-"
    return (f"{s['delta_bytes_median'] / 1e3:,.1f} kB = {s['delta_fraction_median']:.1%} of the "
            f"{s['full_bytes'] / 1e3:,.1f} kB bf16 weights ({s['deltas']} deltas, format {s.get('delta_format', 1)})")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--weights-only" in argv:
        from syncd.app import demo

        return demo.main([a for a in argv if a != "--weights-only"])
    p = build_parser()
    args = p.parse_args(argv)
    if args.workers is None:
        args.workers = 1 if args.engine == "vllm" else 2
    if args.steps < 1 or args.nproc < 1 or args.workers < 1 or args.every_k < 1 or args.max_lag < 0:
        p.error("--steps, --nproc, --workers, --every-k must be >= 1 and --max-lag >= 0")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    summary, status = run_demo(args, name="syncd demo", prefix="syncd-rl-demo-", run=run,
                               print_summary=print_summary, failures=(RuntimeError, TimeoutError, OSError))
    if summary is None:
        return status
    ok = summary["rollouts_lost"] == 0 and summary["engines_bit_exact"] and summary["final_version"] == \
        -(-args.steps // args.every_k) and summary["ranks_agree"] is not False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
