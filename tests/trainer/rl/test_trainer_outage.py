"""The rollout pipeline stays warm through a trainer failure, on real parts (``syncd.app.rl_stack``: two
reference-engine workers under the Dynamo frontend, the sandbox proxy, the node daemon applying every version):
``syncd rollouts`` as its own process, ``syncd train --external-rollouts --checkpoint-dir`` reading the run's queue.

The trainer is killed with SIGKILL mid-run: the service keeps generating while it is away (groups land in the queue
until the backlog is full), and ``--resume`` continues from the checkpoint, reading the queue on from the
checkpointed position. The restart is a warm standby (``--resume --standby``, started before the kill, holding
until ``SIGUSR1``; the cold ``--resume`` is tested by ``tests/trainer/ft/test_resume.py``); the trainer is two ranks
on two nodes, each rank's checkpoints replicated to the other. Asserted: the standby wrote nothing before the signal,
and each of its ranks read a checkpoint ahead; every step once; no prompt trained twice; every trained group is one
the service wrote and the trainer never sent back; the groups generated during the outage are trained after it; the
engines end on the trainer's last version."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.ft_goodput import kill_process_tree
from bench.trainer_elastic import read_lines
from syncd.app.rl_stack import RLStack, StackConfig
from syncd.procs import stop_process, wait_until
from syncd.trainer.rl.group_queue import GroupQueue

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
STEPS, GROUPS, G, BACKLOG = 14, 2, 4, 8  # the trainer's lookahead: 2 x (1 + 1) = 4 groups


def _steps(out: Path) -> list[dict]:
    return [ln for ln in read_lines(out / "metrics.jsonl") if ln.get("kind") == "step"]


def test_the_service_generates_through_a_trainer_kill_and_the_resumed_trainer_loses_and_repeats_nothing(tmp_path):
    stack = RLStack(StackConfig(tmp_path / "stack", run_id="outage", engines=2, seed=1)).start()
    vocab = json.loads((Path(stack.model_dir) / "config.json").read_text())["vocab_size"]
    q = GroupQueue(stack.store_url, stack.run_id)
    svc_log = open(tmp_path / "service.log", "ab")
    svc = subprocess.Popen([sys.executable, "-m", "syncd.trainer.rl.rollout_service", "--store", stack.store_url,
                            "--run-id", stack.run_id, "--proxy", stack.proxy_url, "--task", "repeat",
                            "--task-length", "8", "--group-size", str(G), "--workers", "2", "--max-backlog",
                            str(BACKLOG), "--poll-interval-s", "0.1", "--trainer-timeout-s", "1.5",
                            "--vocab-size", str(vocab)],
                           env=stack.env, cwd=ROOT, stdout=svc_log, stderr=subprocess.STDOUT,
                           start_new_session=True)
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    argv = [sys.executable, "-m", "syncd.trainer.run", "--external-rollouts", "--store", stack.store_url,
            "--run-id", stack.run_id, "--model", str(stack.model_dir), "--daemon-status", str(stack.status_file),
            "--out", str(out), "--steps", str(STEPS), "--groups-per-step", str(GROUPS), "--group-size", str(G),
            "--task", "repeat", "--task-length", "8", "--max-lag", "2", "--no-plot", "--checkpoint-dir", str(ckpt),
            "--nproc", "2", "--node", "node-{rank}", "--replicas", "1", "--rollout-timeout", "240"]
    trainer = standby = None
    try:
        trainer = subprocess.Popen(argv, env=stack.env, cwd=ROOT, stdout=subprocess.DEVNULL,
                                   stderr=open(tmp_path / "trainer-1.err", "w"), start_new_session=True)
        # the restart is a warm standby's: imported, model and optimizer built, holding until SIGUSR1
        standby_err = tmp_path / "trainer-2.err"
        standby = subprocess.Popen([*argv, "--resume", "--standby"], env=stack.env, cwd=ROOT, stdout=subprocess.PIPE,
                                   stderr=open(standby_err, "w"), text=True, start_new_session=True)
        wait_until(lambda: "standby: ready" in standby_err.read_text(), 300, "the standby's warm start",
                   interval_s=0.1, alive=lambda: standby.poll() is not None and standby_err.read_text()[-3000:])
        wait_until(lambda: len(_steps(out)) >= 4, 300, "the trainer's fourth step", interval_s=0.1,
                   alive=lambda: trainer.poll() is not None and (tmp_path / "trainer-1.err").read_text()[-3000:])
        kill_process_tree(trainer)
        killed_after = len(_steps(out))
        landed_at_kill = len(q.state("rollouts-0").landed)
        time.sleep(5)  # the trainer is away (no heartbeat for 1.5 s): the service fills its backlog of 8
        during = len(q.state("rollouts-0").landed) - landed_at_kill
        assert svc.poll() is None
        assert during >= 1, "nothing was generated while the trainer was down"

        starts = [ln for ln in (out / "metrics.jsonl").read_text().splitlines() if '"kind": "start"' in ln]
        assert len(starts) == 1 and standby.poll() is None  # the standby held: it wrote nothing, it did not exit
        trainer = standby
        trainer.send_signal(signal.SIGUSR1)
        stdout, _ = trainer.communicate(timeout=600)
        assert trainer.returncode == 0, (tmp_path / "trainer-2.err").read_text()[-3000:]
        summary = json.loads(stdout.strip().splitlines()[-1])
        stack.wait_engines_at(summary["final_version"], timeout_s=120)
    finally:
        for proc in (trainer, standby):
            if proc is not None and proc.poll() is None:
                kill_process_tree(proc)
        stop_process(svc, 30)
        svc_log.close()
        stack.close()

    steps = _steps(out)
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1)), [s["step"] for s in steps]
    plans = [json.loads(ln) for ln in (out / "plans.jsonl").read_text().splitlines()]
    assert [p["step"] for p in plans] == list(range(1, STEPS + 1))
    trained = []
    for p in plans:
        for g in p["groups"]:
            m = re.search(r"-g(\d{6})(?:r(\d+))?-s\d{2}$", g["trajectories"][0][1])
            assert m and int(m.group(1)) == g["item"]["index"], g["trajectories"]
            trained.append((g["item"]["index"], int(m.group(2) or 0)))
    indices = [i for i, _ in trained]
    assert len(indices) == len(set(indices)) == STEPS * GROUPS  # no prompt trained twice
    st = GroupQueue(stack.store_url, stack.run_id).state("rollouts-0")
    for key in trained:  # each trained group is an attempt the service wrote and the trainer never sent back
        assert key in st.landed and key not in st.failed, key
    err = (tmp_path / "trainer-2.err").read_text()
    assert killed_after < STEPS and err.count("restore:") >= 1
    for rank in (0, 1):  # each rank read a checkpoint ahead
        assert re.search(rf"rank {rank}: standby: steps read ahead: \[\d+", err), err[-3000:]
    assert summary["final_version"] >= STEPS - 1
