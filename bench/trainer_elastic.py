"""Elastic data parallelism on the live path (``python -m bench.trainer_ft --sections elastic``): the RL stack
(``syncd.app.rl_stack``: reference engines under the Dynamo frontend, the sandbox proxy, the node daemon), ``syncd
rollouts`` as its own process, a torchft lighthouse, and two replica groups of ``syncd train --external-rollouts
--lighthouse ...`` (checkpoints replicated to each other, ``--min-replicas 1``). :class:`ElasticRun` is the harness
(also ``tests/trainer/rl/test_elastic_live.py``'s).

Two runs of the same length in one process: failure-free, and one in which the leading group (group 0: it runs the
live side) is killed with SIGKILL after ``--elastic-kill-at`` steps, its node's disk wiped, and started again (a cold
start: a new process, imports included) once the survivor has taken the live side over. Figures (``elastic.*``),
every one from the groups' own ``ft.jsonl`` and metrics lines:

* ``shrink_s``: the kill to the first step committed without the dead group;
* ``takeover_s``: the kill to the survivor's first step as the live side's leader (its heartbeat timeout, ``--leader-
  timeout``, is most of it);
* ``regrow_s``: the restart to the restarted group's first step committed with the survivor (rebuilt from its
  peer's replica, healed live); None, and ``rejoined`` false, when the survivor finished first (the restarted group
  then replays the logged plans alone, from scratch if its peer's replicas went with the peer, and its weights
  differ from the survivor's by the rounding of one participant's sums against two's). ``--elastic-spare`` restarts
  it from a warm spare (imports done), as a scheduler's pre-started replacement;
* ``goodput`` (= ``goodput_ratio``): committed steps per second of the failing run (first commit to the last,
  ``goodput_failing``) over the failure-free run's (``goodput_plain``), rollout-bound on this tiny model;
* ``prompts_duplicated``, ``weights_equal`` (the two groups' digests at the end).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.ft_goodput import kill_process_tree

__all__ = ["ElasticRun", "SPARE", "bench_elastic", "read_lines"]

ROOT = Path(__file__).resolve().parents[1]

SPARE = r"""
import json, sys
import torch, torchft, transformers  # noqa: F401 -- the slow part of a start
import syncd.trainer.jobs, syncd.trainer.run  # noqa: F401
print("ready", file=sys.stderr, flush=True)
sys.stdin.readline()
sys.exit(syncd.trainer.run.main(json.loads(sys.argv[1])))
"""


def read_lines(path: Path) -> list[dict]:
    """The JSON lines of ``path`` (none if missing; a killed process's torn last line skipped)."""
    out = []
    if path.exists():
        for ln in path.read_text().splitlines():
            try:
                out.append(json.loads(ln))
            except ValueError:
                continue
    return out


class ElasticRun:
    """The stack, the rollout service, the lighthouse and two replica groups under ``work`` (module docstring);
    each group a process started, killed and restarted by the caller. ``close()`` stops everything."""

    FLAGS = ("--task", "repeat", "--task-length", "8", "--group-size", "4")

    def __init__(self, work: Path, *, steps: int, groups_per_step: int = 2, backlog: int = 8,
                 leader_timeout_s: float = 5.0, min_replicas: int = 1, run_id: str = "elastic"):
        from syncd.app.rl_stack import RLStack, StackConfig

        self.work, self.steps, self.procs, self.lives, self.spares = work, steps, {}, {}, []
        self.leader_timeout_s = leader_timeout_s
        self.min_replicas, self.svc = min_replicas, None
        self.stack = RLStack(StackConfig(work / "stack", run_id=run_id, engines=2, seed=1)).start()
        self.out = work / "out"
        self._logs = [open(work / "service.log", "ab"), open(work / "lighthouse.log", "w")]
        self._svc_argv = self.stack.rollouts_argv(*self.FLAGS, "--workers", "2", "--max-backlog", str(backlog),
                                                  "--poll-interval-s", "0.1", "--trainer-timeout-s", "1.5")
        self.start_service()
        self.lh, self.lighthouse = self._lighthouse("127.0.0.1:0")
        self.argv = lambda g: self.stack.trainer_argv(
            "--out", str(self.out), "--steps", str(steps), "--groups-per-step", str(groups_per_step), *self.FLAGS,
            "--max-lag", "2", "--no-plot", "--rollout-timeout", "240", "--lighthouse", self.lighthouse,
            "--replica-groups", "2", "--replica-group", str(g), "--min-replicas", str(min_replicas),
            "--checkpoint-dir", str(self.node(g)), "--replicas", "1", "--ft-timeout", "20", "--leader-timeout",
            str(leader_timeout_s), external_rollouts=True)
        self.env = {**self.stack.env, "SYNCD_REPLICA_SECRET_FILE": str(work / "replica-secret")}

    def _lighthouse(self, bind: str):
        from syncd.trainer.ft.elastic import start_lighthouse

        return start_lighthouse(self.min_replicas, bind=bind, heartbeat_timeout_ms=2000, join_timeout_ms=1000,
                                log_file=self._logs[1])

    def start_service(self) -> None:
        """Start ``syncd rollouts`` (again: it continues from the queue in the store)."""
        self.svc = subprocess.Popen(self._svc_argv, env=self.stack.env, cwd=ROOT, stdout=self._logs[0],
                                    stderr=subprocess.STDOUT, start_new_session=True)

    def kill_service(self) -> None:
        kill_process_tree(self.svc)

    def restart_lighthouse(self, down_s: float = 1.0) -> None:
        """SIGKILL the lighthouse, keep it down ``down_s`` seconds, start it again on the same address."""
        self.lh.kill()
        self.lh.wait()
        time.sleep(down_s)
        self.lh, url = self._lighthouse(self.lighthouse.removeprefix("http://"))
        if url != self.lighthouse:
            raise RuntimeError(f"the lighthouse came back at {url}, not {self.lighthouse}")

    def node(self, g: int) -> Path:
        """Group ``g``'s node-local checkpoint folder."""
        return self.work / f"node-{g}"

    def start(self, g: int, *, spare: bool = False) -> subprocess.Popen:
        """Start group ``g``'s next life; ``spare``: a process that does its imports and waits (a scheduler's
        pre-started replacement), returned once ready and run by :meth:`go`."""
        from syncd.procs import wait_until

        life = self.lives.get(g, -1) + 1
        argv = [sys.executable, "-c", SPARE, json.dumps(self.argv(g)[3:])] if spare else self.argv(g)
        err = self.work / f"g{g}.{life}.err"
        p = subprocess.Popen(argv, env=self.env, cwd=ROOT, stdin=subprocess.PIPE if spare else None, text=True,
                             stdout=open(self.work / f"g{g}.{life}.out", "w"), stderr=open(err, "w"),
                             start_new_session=True)
        if spare:
            self.spares.append(p)
            wait_until(lambda: "ready" in err.read_text(), 300, "the spare's imports",
                       alive=lambda: p.poll() is not None and "the spare exited")
        else:
            self.lives[g], self.procs[g] = life, p
        return p

    def go(self, g: int, p: subprocess.Popen) -> None:
        """Let the spare ``p`` run as group ``g``'s next life."""
        self.lives[g], self.procs[g] = self.lives.get(g, -1) + 1, p
        p.stdin.write("go\n")
        p.stdin.flush()

    def kill(self, g: int, *, wipe: bool = True) -> float:
        """SIGKILL group ``g`` (``wipe``: its node's disk goes with it); the time of the kill."""
        kill_process_tree(self.procs[g])
        t = time.time()
        if wipe:
            shutil.rmtree(self.node(g), ignore_errors=True)
        return t

    def tail(self, g: int) -> str:
        return (self.work / f"g{g}.{self.lives[g]}.err").read_text()[-3000:]

    def events(self, g: int) -> list[dict]:
        return read_lines(self.out / f"group-{g}" / "ft.jsonl")

    def metrics(self, g: int) -> list[dict]:
        return read_lines(self.out / f"group-{g}" / "metrics.jsonl")

    def committed(self, g: int, since: float = 0.0) -> list[dict]:
        return [e for e in self.events(g) if e["kind"] == "attempt" and e["committed"] and e["t"] >= since]

    def wait(self, what: str, cond, g: int, timeout_s: float = 300) -> None:
        from syncd.procs import wait_until

        wait_until(cond, timeout_s, what, interval_s=0.05,
                   alive=lambda: self.procs[g].poll() is not None and f"group {g} exited:\n{self.tail(g)}")

    def leading_since(self, g: int, t: float) -> bool:
        """Whether group ``g`` wrote a step line (it leads) after ``t``."""
        return any(ln.get("kind") == "step" and ln["t"] > t for ln in self.metrics(g))

    def finish(self, timeout_s: float = 900) -> dict[int, dict]:
        """Wait for every group to end; its summary (the last line it printed). RuntimeError if one failed."""
        out = {}
        for g, p in self.procs.items():
            if p.wait(timeout_s) != 0:
                raise RuntimeError(f"group {g} exited {p.returncode}:\n{self.tail(g)}")
            out[g] = json.loads((self.work / f"g{g}.{self.lives[g]}.out").read_text().strip().splitlines()[-1])
        return out

    def close(self) -> None:
        from syncd.procs import stop_process

        for p in [*self.procs.values(), *self.spares]:
            if p.poll() is None:
                kill_process_tree(p)
        if self.svc is not None:
            stop_process(self.svc, 30)
        self.lh.kill()
        self.lh.wait()
        for f in self._logs:
            f.close()
        self.stack.close()


def _goodput(run: ElasticRun) -> float:
    ts = sorted({e["step"]: e["t"] for g in (0, 1) for e in run.committed(g)}.values())
    return (len(ts) - 1) / (ts[-1] - ts[0]) if len(ts) > 1 else 0.0


def _trained(run: ElasticRun) -> list[int]:
    from syncd.trainer.ft.plan_log import PlanLog

    plans = PlanLog(run.stack.store_url, run.stack.run_id, signing_key=run.stack.verify_key)
    return [g["item"]["index"] for s in range(1, run.steps + 1) for g in plans.get(s)["groups"]]


def bench_elastic(args, work: Path) -> dict:
    """A failure-free run and one with the leader killed (module docstring); the ``elastic`` member of
    bench.trainer_ft's JSON."""
    steps, kill_at = args.elastic_steps, args.elastic_kill_at
    plain = ElasticRun(work / "plain", steps=steps)
    try:
        for g in (0, 1):
            plain.start(g)
        plain_summary = plain.finish()
        goodput_plain = _goodput(plain)
    finally:
        plain.close()
    run = ElasticRun(work / "failing", steps=steps)
    try:
        for g in (0, 1):
            run.start(g)
        spare = run.start(0, spare=True) if args.elastic_spare else None  # its imports done before the kill
        run.wait(f"group 0 at step {kill_at}", lambda: any(e["step"] >= kill_at for e in run.committed(0)), 0)
        held = run.node(1) / "group-1" / "held" / "group-0"
        run.wait("a replica of group 0 on group 1's node", lambda: held.exists() and any(held.iterdir()), 1)
        t_kill = run.kill(0)
        run.wait("group 1 leading", lambda: run.leading_since(1, t_kill), 1)
        if spare is not None:
            t_restart = time.time()
            run.go(0, spare)
        else:
            t_restart = time.time()
            run.start(0)
        summary = run.finish()
        goodput_failing = _goodput(run)
        alone = [e for e in run.committed(1, t_kill) if e["participants"] == 1]
        led = [ln["t"] for ln in run.metrics(1) if ln.get("kind") == "step" and ln["t"] > t_kill]
        back = [e for e in run.committed(0, t_restart) if e["participants"] == 2]
        trained = _trained(run)
    finally:
        run.close()
    return {"steps": steps, "killed_after_step": kill_at, "leader_timeout_s": run.leader_timeout_s,
            "shrink_s": alone[0]["t"] - t_kill if alone else None, "takeover_s": min(led) - t_kill,
            "regrow_s": back[0]["t"] - t_restart if back else None, "rejoined": bool(back),
            "goodput_plain": goodput_plain, "goodput_failing": goodput_failing,
            "goodput_ratio": goodput_failing / goodput_plain if goodput_plain else None,
            "goodput": goodput_failing / goodput_plain if goodput_plain else None,  # the name for the ratio
            "prompts_duplicated": len(trained) - len(set(trained)),
            "weights_equal": summary[0]["digest"] == summary[1]["digest"],
            "plain_weights_equal": plain_summary[0]["digest"] == plain_summary[1]["digest"],
            "restart": "a warm spare (imports done: restore from the peer's replica, quorum, live heal)"
            if args.elastic_spare else "cold (a new process: imports, restore from the peer's replica, quorum, live "
            "heal)",
            "params": "the stack's tiny model (hidden 64, 2 layers)"}
