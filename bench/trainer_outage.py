"""A trainer outage with the rollout pipeline warm (``python -m bench.trainer_ft --sections outage``): the RL stack
(``syncd.app.rl_stack``: reference engines under the Dynamo frontend, the sandbox proxy, the node daemon), ``syncd
rollouts`` as its own process and ``syncd train --external-rollouts --checkpoint-dir``. The trainer runs, is killed
with SIGKILL, stays away ``--outage-s`` seconds, and comes back (a warm standby, or ``--resume``) to the end of the
run.

Figures (``outage.*``), every one from the run's own records:

* ``gen_tokens_per_s_before`` / ``gen_tokens_per_s_during``: tokens of the groups the service wrote to the queue
  per second, each group's ``tokens`` spread evenly from its ``requested_at`` to its ``finished_at``, from the
  trainer's first step to the kill (the service is started once the trainer's heartbeat is there, so this is the
  steady state) and over the outage (goal: during >= 0.8 x before -- the engines do not idle while the trainer is
  down; before is paced by the trainer's lookahead, during by ``--outage-backlog``). Counted at the finish alone, a
  95M model's 512-token groups made the figure a count of the two or three groups that happened to finish in a 15 s
  window: 0.27x in a run whose same groups, spread over their generation, give 1.75x;
* ``restart_to_first_step_s``: from the restart to the restored trainer's first committed step (its metrics line),
  and ``restart_to_restore_s`` to its ``restore`` line (checkpoint loaded, live side started). ``restart``
  (``--outage-restart``) says which restart: ``standby`` (the default), a warm standby started before the kill
  (``--resume --standby``: imported, model and optimizer built, ranks connected; the restart is the ``SIGUSR1`` the
  benchmark sends it, as a supervisor would), or ``cold``, a new ``--resume`` process (its imports included);
* ``prompts_duplicated``: prompts trained more than once; ``prompts_lost``: prompts below the highest one the service
  claimed that it never claimed (a skipped prompt), plus trained groups not in the queue as an attempt the trainer
  kept (goal 0 and 0);
* ``task_mix_p_value``: the run's task is ``mix`` (``repeat`` and a 4x longer ``reverse``, alternating prompts:
  the short task's groups pile up faster during the outage); the chi-square test of homogeneity
  (:func:`syncd.trainer.rl.buffer_policy.mix_p_value`) of the task mix trained in the steps after the restart against
  the mix trained before the kill, the same run's steady state without an outage (goal >= 0.01; the buffer policy's
  own test, ``tests/trainer/rl/test_buffer_policy.py``, compares with a separate run and shows a naive policy fail).

What the outage costs: the service generates on the last published version while the trainer is away; the restored
trainer can train at most ``(eta + 1) x groups per step`` of one version (the buffer policy's cap) before they are
stale, and sends the rest back to be generated again (``groups_sent_back``): ``--max-backlog`` trades engine work
during an outage against that waste.

The model is the stack's tiny one by default; ``--outage-hidden`` and ``--outage-layers`` size it (hidden 1024, 10
layers: about 100M parameters, engines and trainer alike), and ``--outage-replicas K`` runs the trainer as two
ranks on two nodes, each rank's checkpoint replicated to the other (``params``, ``replicas`` in the JSON).
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

from bench._report import model_params
from bench.ft_goodput import kill_process_tree
from bench.trainer_elastic import read_lines

__all__ = ["bench_outage"]

ROOT = Path(__file__).resolve().parents[1]


def _lines(out: Path) -> list[dict]:
    """The trainer's metrics lines (a killed trainer's torn last line skipped)."""
    return read_lines(out / "metrics.jsonl")


def _steps(out: Path) -> list[dict]:
    return [d for d in _lines(out) if d.get("kind") == "step"]


def _rate(groups: list[dict], t0: float, t1: float) -> float:
    """Tokens per second generated in ``[t0, t1)``: each group's tokens spread evenly over the time from its request
    to its finish (``requested_at`` to ``finished_at``), the share inside the window counted."""
    total = 0.0
    for g in groups:
        a, b = g["requested_at"], g["finished_at"]
        if b <= a:
            total += g["tokens"] if t0 <= b < t1 else 0
        else:
            total += g["tokens"] * max(0.0, min(b, t1) - max(a, t0)) / (b - a)
    return total / (t1 - t0)


def bench_outage(args, work: Path) -> dict:
    """One outage run (module docstring); the ``outage`` member of bench.trainer_ft's JSON."""
    from syncd.app.rl_stack import RLStack, StackConfig
    from syncd.procs import stop_process, wait_until
    from syncd.trainer.rl.buffer_policy import mix_p_value
    from syncd.trainer.rl.group_queue import GroupQueue

    stack = RLStack(StackConfig(work / "stack", run_id="outage", engines=2, seed=1, hidden=args.outage_hidden,
                                layers=args.outage_layers)).start()
    flags = ("--task", "mix", "--task-length", "8", "--group-size", "4")
    out, ckpt = work / "out", work / "ckpt"
    # with replicas: two ranks on two "nodes", each rank's checkpoint replicated to the other's holder
    ranks = ("--nproc", "2", "--node", "node-{rank}", "--replicas", str(args.outage_replicas)) \
        if args.outage_replicas else ("--replicas", "0")
    argv = [*stack.trainer_argv("--out", str(out), "--steps", str(args.outage_steps), "--groups-per-step", "2",
                                "--max-lag", "2", "--no-plot", "--checkpoint-dir", str(ckpt), *ranks,
                                "--rollout-timeout", "900", *flags, external_rollouts=True)]
    logs = {name: open(work / f"{name}.log", "ab") for name in ("rollouts", "trainer-1", "trainer-2")}
    q = GroupQueue(stack.store_url, stack.run_id)
    trainer = svc = standby = None
    try:  # the trainer first: the service starts paced by its heartbeat, so "before" is the steady state
        trainer = subprocess.Popen(argv, env=stack.env, cwd=ROOT, stdout=subprocess.DEVNULL,
                                   stderr=logs["trainer-1"], start_new_session=True)
        if args.outage_restart == "standby":
            standby = subprocess.Popen([*argv, "--resume", "--standby"], env=stack.env, cwd=ROOT,
                                       stdout=subprocess.DEVNULL, stderr=logs["trainer-2"], start_new_session=True)
            wait_until(lambda: "standby: ready" in (work / "trainer-2.log").read_text(), 600, "the standby's warm "
                       "start", interval_s=0.1, alive=lambda: standby.poll() is not None and "the standby exited")
        wait_until(lambda: "lookahead" in q.consumer(), 300, "the trainer's heartbeat", interval_s=0.1,
                   alive=lambda: trainer.poll() is not None and f"the trainer exited {trainer.returncode}")
        svc = subprocess.Popen(stack.rollouts_argv(*flags, "--max-backlog", str(args.outage_backlog),
                                                   "--trainer-timeout-s", "2", "--poll-interval-s", "0.1"),
                               env=stack.env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=logs["rollouts"],
                               start_new_session=True)
        kill_at = args.outage_steps // 2
        wait_until(lambda: len(_steps(out)) >= kill_at, 900, f"the trainer's step {kill_at}", interval_s=0.1,
                   alive=lambda: trainer.poll() is not None and f"the trainer exited {trainer.returncode}")
        kill_process_tree(trainer)
        killed = time.time()
        time.sleep(args.outage_s)
        restarted = time.time()
        if standby is not None:
            trainer = standby
            trainer.send_signal(signal.SIGUSR1)
        else:
            trainer = subprocess.Popen([*argv, "--resume"], env=stack.env, cwd=ROOT, stdout=subprocess.DEVNULL,
                                       stderr=logs["trainer-2"], start_new_session=True)
        if trainer.wait(1800) != 0:
            raise RuntimeError(f"the restored trainer exited {trainer.returncode}: see {work / 'trainer-2.log'}")
    finally:
        for proc in (trainer, standby):
            if proc is not None and proc.poll() is None:
                kill_process_tree(proc)
        if svc is not None:
            stop_process(svc, 30, signal.SIGTERM)
        for f in logs.values():
            f.close()
        stack.close()

    items, _ = q.read_groups("rollouts-0", 0, limit=10 ** 6)
    groups = [d for d in items if isinstance(d, dict)]
    plans = [json.loads(ln) for ln in (out / "plans.jsonl").read_text().splitlines()]
    trained = [g["item"]["index"] for p in plans for g in p["groups"]]
    st = q.state("rollouts-0")
    claimed = {i for i, _ in st.claims}
    written = {(d["item"]["index"], tuple(map(tuple, d["trajectories"]))) for d in groups}
    missing = sum((g["item"]["index"], tuple(map(tuple, g["trajectories"]))) not in written
                  for p in plans for g in p["groups"])
    steps = _steps(out)
    resumed_at = min(s["step"] for s in steps if s["t"] >= restarted)  # the restored trainer's first step
    mix = {"before": {}, "after": {}}
    for p in plans:
        side = mix["before" if p["step"] < resumed_at else "after"]
        for g in p["groups"]:
            task = (g["item"].get("meta") or {}).get("task", "")
            side[task] = side.get(task, 0) + 1
    p_value = mix_p_value(mix["after"], mix["before"])[0]
    first_step = min(s["t"] for s in steps if s["t"] >= restarted)  # the restored trainer's first line
    restored_at = min(d["t"] for d in _lines(out) if d.get("kind") == "restore" and d["t"] >= restarted)
    started = min(s["t"] for s in steps)  # the steady state: from the first step to the kill
    before_rate = _rate(groups, started, killed)
    during_rate = _rate(groups, killed, restarted)
    return {"steps": args.outage_steps, "killed_after_step": kill_at, "outage_s": restarted - killed,
            "backlog": args.outage_backlog, "gen_tokens_per_s_before": before_rate,
            "gen_tokens_per_s_during": during_rate,
            "during_over_before": during_rate / before_rate if before_rate else None,
            "restart": args.outage_restart,
            "restart_to_first_step_s": first_step - restarted,
            "restart_to_restore_s": restored_at - restarted,
            "prompts_duplicated": len(trained) - len(set(trained)),
            "prompts_lost": len(set(range(max(claimed, default=-1) + 1)) - claimed) + missing,
            "task_mix_p_value": p_value, "task_mix": mix, "groups_written": len(groups), "groups_trained": len(trained),
            "groups_sent_back": sum(1 for k in st.failed if k in st.landed),
            "params": model_params(stack.model_dir), "hidden": args.outage_hidden, "layers": args.outage_layers,
            "replicas": args.outage_replicas}
