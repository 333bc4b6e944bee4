"""The goodput section of :mod:`bench.trainer_ft`: the thin trainer (``python -m syncd.trainer.run --nproc 2
--checkpoint-dir``, offline on recorded rollouts, :mod:`bench.ft_data`) killed with SIGKILL every ``--fail-every``
steps and resumed, against a failure-free run of the same steps: steps lost per failure (the last step the run
reported before the kill, minus the resume step) and goodput (steps per wall second, process starts included).
:func:`kill_process_tree` is the kill the resume tests use too."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench._timing import clock, median

__all__ = ["bench_goodput", "kill_process_tree"]

ROOT = Path(__file__).resolve().parents[1]


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def kill_process_tree(p: subprocess.Popen) -> None:
    """SIGKILL ``p`` and the processes it started (``syncd.trainer.run --nproc`` starts its ranks in their own sessions,
    so a process-group kill would miss them), then reap ``p``."""
    victims = [p.pid, *_children(p.pid)]
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.wait()
    for pid in victims[1:]:
        for _ in range(200):
            try:
                state = Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0]
            except (OSError, IndexError):
                break
            if "Z" in state:
                break
            time.sleep(0.05)


def _trained(out: Path) -> list[int]:
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return []
    steps = []
    for ln in lines:
        try:
            d = json.loads(ln)
        except ValueError:
            continue
        if d.get("kind") == "step":
            steps.append(d["step"])
    return steps


def bench_goodput(args, work: Path) -> dict:
    from bench.ft_data import write_offline_plans
    from syncd.engine.reference.make_tiny import write_model

    model = write_model(work / "model")
    store = f"file://{work / 'store'}"
    plans = write_offline_plans(model, store, "gp", work / "plans.jsonl", steps=args.goodput_steps, groups=4,
                                group_size=4, distinct=8)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SYNCD_NODE": "node-{rank}"}

    def argv(name: str, *extra: str) -> list[str]:
        return [sys.executable, "-m", "syncd.trainer.run", "--model", str(model), "--store", store, "--run-id", "gp",
                "--plans", str(plans), "--steps", str(args.goodput_steps), "--groups-per-step", "4",
                "--group-size", "4", "--out", str(work / name / "out"), "--no-plot", "--nproc", "2",
                "--checkpoint-dir", str(work / name / "ckpt"), "--replicas", "1", "--checkpoint-busy", args.busy,
                *extra]

    t0 = clock()
    subprocess.run(argv("plain"), cwd=ROOT, env=env, check=True, capture_output=True, timeout=1800)
    plain_s = clock() - t0

    t0 = clock()
    lost, restarts, start = [], [], 0
    last, t_kill = 0, 0.0  # set by each kill, read by the next life
    life = 0
    while True:
        err = work / f"life{life}.err"
        with open(err, "w") as fe:
            p = subprocess.Popen(argv("failing", *(["--resume"] if life else [])), cwd=ROOT, env=env,
                                 stdout=subprocess.DEVNULL, stderr=fe, start_new_session=True)
        if life:
            start = _resumed_at(err, p)
            lost.append(last - start)
            restarts.append(clock() - t_kill)
        target = start + args.fail_every
        if target >= args.goodput_steps:  # no failure due before the end
            p.wait()
        while p.poll() is None and max(_trained(work / "failing" / "out"), default=0) < target:
            time.sleep(0.01)
        if p.poll() is not None:
            if p.returncode != 0:
                raise RuntimeError(f"syncd.trainer.run failed: {err.read_text()[-2000:]}")
            break
        kill_process_tree(p)
        t_kill = clock()
        last = max(_trained(work / "failing" / "out"))
        life += 1
    failing_s = clock() - t0
    s = args.goodput_steps
    ck = json.loads((work / "plain" / "out" / "summary.json").read_text()).get("checkpoints") or {}
    return {"steps": s, "fail_every": args.fail_every, "busy": args.busy, "failures": len(lost), "steps_lost": lost,
            "plain_checkpoint_stall_s": ck.get("stall_s"), "plain_checkpoints_saved": ck.get("saved"),
            "plain_checkpoints_skipped": ck.get("skipped"),
            "steps_lost_per_failure": sum(lost) / len(lost) if lost else 0.0,
            "restart_to_resumed_s": median(restarts), "plain_wall_s": plain_s, "failing_wall_s": failing_s,
            "goodput_plain": s / plain_s, "goodput_failing": s / failing_s,
            "goodput_ratio": plain_s / failing_s}


def _resumed_at(err: Path, p: subprocess.Popen) -> int:
    while True:
        for ln in err.read_text().splitlines():
            if "rank 0: resumed at step" in ln:
                return int(ln.rsplit(" ", 1)[1])
        if p.poll() is not None:
            raise RuntimeError(f"syncd.trainer.run did not resume: {err.read_text()[-2000:]}")
        time.sleep(0.01)
