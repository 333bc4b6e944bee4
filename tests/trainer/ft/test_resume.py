"""kill -9 of the whole trainer (``python -m syncd.trainer.run --nproc 2 --checkpoint-dir``: both ranks, gloo, each on
its own "node" with a replica on the other) at random points, restarted with ``--resume`` each time, training
offline on recorded rollouts (``bench.ft_data``). Whatever the kill points (seeded, so a failure reproduces):

* no extra or missing optimizer step (TRL 6823): the final weights are bit-identical to an uninterrupted run's and
  AdamW's step count is the number of steps;
* no prompt lost or trained twice: the run's record (``metrics.jsonl``) holds every step exactly once with the
  plan's groups, in order;
* each restart resumes at a step no older than the last one its checkpoints had made durable before the kill,
  and at most one step behind the last step the run had reported (``metrics.jsonl``).

The prompt ledger's properties over random kill points (what the live side's buffer holds) are in
test_rl_state.py; the in-process checkpoint properties in test_checkpoint.py."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from bench.ft_goodput import kill_process_tree

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]
STEPS, GROUPS, G = 30, 4, 4
KILLS = 2


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from bench.ft_data import write_offline_plans
    from syncd.engine.reference.make_tiny import write_model

    root = tmp_path_factory.mktemp("resume")
    model = write_model(root / "model")
    store = f"file://{root / 'store'}"
    plans = write_offline_plans(model, store, "rs", root / "plans.jsonl", steps=STEPS, groups=GROUPS, group_size=G,
                                distinct=12)
    return {"root": root, "model": model, "store": store, "plans": plans}


def _argv(data, out: Path, ckpt: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "syncd.trainer.run", "--model", str(data["model"]), "--store", data["store"],
            "--run-id", "rs", "--plans", str(data["plans"]), "--steps", str(STEPS), "--groups-per-step", str(GROUPS),
            "--group-size", str(G), "--out", str(out), "--no-plot", "--save-weights", "--nproc", "2",
            "--checkpoint-dir", str(ckpt), "--replicas", "1", *extra]


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "SYNCD_NODE": "node-{rank}"}


def _durable(ckpt: Path) -> int:
    """The newest step both ranks have a complete checkpoint of on disk (a resume may not go back further)."""
    from syncd.trainer.ft.checkpoint import list_steps, newest_checkpoint

    common = None
    for r in (0, 1):
        own = ckpt / f"rank-{r}" / "own"
        ok = {s for s in list_steps(own) if newest_checkpoint(own, owner=f"rank-{r}", step=s) is not None}
        common = ok if common is None else common & ok
    return max(common, default=0)


def test_kill_9_of_the_whole_trainer_at_random_points_loses_and_repeats_nothing(data, tmp_path):
    ref = subprocess.run(_argv(data, tmp_path / "ref", tmp_path / "ref-ckpt"), cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=600)
    assert ref.returncode == 0, ref.stderr[-3000:]

    out, ckpt = tmp_path / "run", tmp_path / "ckpt"
    rng = random.Random(18)
    resumed_at, floors, reported = [], [], []
    for life in range(KILLS + 1):
        argv = _argv(data, out, ckpt, *(["--resume"] if life else []))
        log = open(tmp_path / f"life{life}.err", "w")
        p = subprocess.Popen(argv, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=log, text=True,
                             start_new_session=True)
        if life == KILLS:
            stdout, _ = p.communicate(timeout=600)
            assert p.returncode == 0, (tmp_path / f"life{life}.err").read_text()[-3000:]
            break
        deadline = time.monotonic() + 300
        floor = max(floors, default=0)
        while _durable(ckpt) <= floor and p.poll() is None:  # this life made progress of its own ...
            assert time.monotonic() < deadline
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.6))  # ... then dies at a random point: mid-step, mid-write, or done
        if p.poll() is not None:  # it finished before the kill
            assert p.returncode == 0, (tmp_path / f"life{life}.err").read_text()[-3000:]
            break
        kill_process_tree(p)  # every rank: the whole trainer
        floors.append(_durable(ckpt))
        reported.append(max((json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()
                             if json.loads(ln)["kind"] == "step"), default=0))
    log.close()
    for life in range(1, len(floors) + 1):
        err = (tmp_path / f"life{life}.err").read_text()
        starts = [int(ln.rsplit(" ", 1)[1]) for ln in err.splitlines() if "rank 0: resumed at step" in ln]
        assert starts, err[-3000:]
        resumed_at.append(starts[0])
    assert all(r >= f for r, f in zip(resumed_at, floors)), (resumed_at, floors)  # never behind what was durable
    # --checkpoint-busy wait (the default): a step is reported only once every rank's previous one is written, so a
    # kill costs at most one reported step, however slow the writes are
    assert all(r >= t - 1 for r, t in zip(resumed_at, reported)), (resumed_at, reported)
    assert len(resumed_at) >= 2  # the kills did land before the end

    a, b = load_file(str(tmp_path / "ref" / "weights.safetensors")), load_file(str(out / "weights.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # bit for bit: no extra/missing step

    from syncd.trainer.ft.checkpoint import newest_checkpoint

    c = newest_checkpoint(ckpt / "rank-0" / "own", owner="rank-0")
    parts = c.optim if isinstance(c.optim, list) else [c.optim]  # AdamW alone, or Muon + AdamW
    assert c.step == STEPS and {int(v["step"]) for o in parts for v in o["state"].values()} == {STEPS}

    plans = [json.loads(ln) for ln in data["plans"].read_text().splitlines()]
    lines = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [ln for ln in lines if ln["kind"] == "step"]
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))  # each step once: no prompt lost or twice
    assert [s["groups"] for s in steps] == [[g["gid"] for g in p["groups"]] for p in plans]


def test_in_skip_mode_every_rank_skips_the_same_steps(data, tmp_path):
    """``--checkpoint-busy skip``: a rank whose write is still going skips the step's checkpoint, and so do the
    others (they decide together), so a restart always finds steps that every rank can restore. Whether any step
    is skipped depends on the machine's speed; the sets must be equal either way."""
    from syncd.trainer.ft.checkpoint import list_steps

    ckpt = tmp_path / "ckpt"
    p = subprocess.run(_argv(data, tmp_path / "out", ckpt, "--checkpoint-busy", "skip", "--keep-checkpoints",
                             str(STEPS)), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    steps = [list_steps(ckpt / f"rank-{r}" / "own") for r in (0, 1)]
    assert steps[0] == steps[1], steps
    assert steps[0][0] == STEPS  # the last step is always checkpointed
    skipped = json.loads(p.stdout)["checkpoints"]["skipped"]
    assert skipped == STEPS - len(steps[0]), (skipped, steps[0])


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _steps(out: Path) -> list[int]:
    return [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()
            if json.loads(ln)["kind"] == "step"]


def test_a_poisoned_replica_costs_a_step_not_the_resume_and_a_new_run_id_is_refused(data, tmp_path):
    """Issue 40: (A.11) at a clean end of a 2-rank job each rank's last checkpoint is on its holder (no rank closes
    its replica server before the other's last push); (A.2) rank 1's disk is lost and its newest replica, on rank 0,
    has one flipped bit: ``--resume`` agrees on the newest step every rank can actually load -- the step before --
    and the run goes on; (A.6) the same checkpoint folder under another run id is refused, naming both ids, with
    or without ``--resume``."""
    from syncd.trainer.ft.checkpoint import list_steps, step_dir

    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    first = subprocess.run(_argv(data, out, ckpt, "--steps", "6"), cwd=ROOT, env=ENV, capture_output=True, text=True,
                           timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    for owner, holder in (("rank-0", "rank-1"), ("rank-1", "rank-0")):
        assert list_steps(ckpt / holder / "held" / owner) == [6, 5], (owner, first.stderr[-3000:])

    shutil.rmtree(ckpt / "rank-1")  # rank 1's node-local disk is gone ...
    _flip(step_dir(ckpt / "rank-0" / "held" / "rank-1", 6) / "model.safetensors")  # ... its newest replica rotted
    again = subprocess.run(_argv(data, out, ckpt, "--steps", "8", "--resume"), cwd=ROOT, env=ENV,
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "rank 0: resumed at step 5" in again.stderr and "rank 1: resumed at step 5" in again.stderr
    assert "step 6 cannot be restored on every rank; trying an older step" in again.stderr
    assert _steps(out) == list(range(1, 9))  # step 6 trained again, once

    for extra in ((), ("--resume",)):
        other = _argv(data, tmp_path / "other", ckpt, *extra)
        other[other.index("--run-id") + 1] = "rs-new"
        p = subprocess.run(other, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
        assert p.returncode == 2, p.stderr[-3000:]
        assert "of run 'rs', not of this run 'rs-new'" in p.stderr, p.stderr[-3000:]
