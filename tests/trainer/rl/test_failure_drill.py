"""The failure drill (issue 36): while the engines serve and the node daemon applies every version, on a seeded
random schedule the rollout service, one trainer replica group, the whole trainer (both groups) and the torchft
lighthouse are each killed with SIGKILL and started again with the same command line (the harness is
:class:`bench.trainer_elastic.ElasticRun`: the RL stack, ``syncd rollouts``, a lighthouse, two replica groups with
``--external-rollouts``).

``--min-replicas 2``: every committed step is the sum of the same two shares, so an offline replay of the recorded
plans on two ranks (``syncd.trainer.run --nproc 2 --plans``) must reproduce every committed step's loss and the final
weights bit for bit. Asserted besides: every step in the plan log once, no prompt trained twice, no prompt skipped by
the service, every trained group an attempt the service wrote and the trainer never sent back, the versions one chain
that verifies deeply, and the engines bit-exact on the last version, which is the trainer's final weights.
"""

from __future__ import annotations

import json
import logging
import random
import subprocess
import sys
import time

import pytest

from bench.trainer_elastic import ElasticRun, ROOT, read_lines
from syncd.trainer.ft.plan_log import PlanLog
from syncd.trainer.rl.group_queue import GroupQueue
from syncd.versions import verify_run

pytestmark = [pytest.mark.integration, pytest.mark.slow]

log = logging.getLogger(__name__)

STEPS, GROUPS, SEED = 44, 2, 36


def _schedule(rng: random.Random) -> list[tuple[str, int]]:
    """The four faults in a random order, each at a random step (at least 6 steps apart, the first after step 4)."""
    faults = ["service", "group", "trainer", "lighthouse"]
    rng.shuffle(faults)
    return [(f, 5 + 8 * i + rng.randint(0, 2)) for i, f in enumerate(faults)]


def _newest_step(run: ElasticRun) -> int:
    return max((e["step"] for g in (0, 1) for e in run.committed(g)), default=0)


def test_the_failure_drill_loses_nothing_and_every_step_matches_an_offline_replay(tmp_path):
    rng = random.Random(SEED)
    schedule = _schedule(rng)
    run = ElasticRun(tmp_path, steps=STEPS, groups_per_step=GROUPS, min_replicas=2)
    stack, done = run.stack, []
    try:
        for g in (0, 1):
            run.start(g)
        for fault, at in schedule:
            run.wait(f"step {at} (before the {fault} fault)", lambda: _newest_step(run) >= at, 1, timeout_s=600)
            down = rng.uniform(0.5, 2.0)
            if fault == "service":
                run.kill_service()
                time.sleep(down)
                run.start_service()
            elif fault == "group":
                victim = rng.choice((0, 1))
                run.kill(victim, wipe=False)
                time.sleep(down)
                run.start(victim)
                fault = f"group {victim}"
            elif fault == "trainer":
                for g in (0, 1):
                    run.kill(g, wipe=False)
                time.sleep(down)
                for g in (0, 1):
                    run.start(g)
            else:
                run.restart_lighthouse(down)
            done.append((fault, _newest_step(run)))
            log.warning("drill: %s killed and restarted at step %d", fault, done[-1][1])
        summary = run.finish()
        final = summary[0].get("final_version", summary[1].get("final_version"))
        stack.wait_engines_at(final, timeout_s=120)
        exact = stack.engines_bit_exact(final)
    finally:
        run.close()
    assert [f.split()[0] for f, _ in done] == [f for f, _ in schedule]

    # one model at the end, every step committed
    assert summary[0]["digest"] == summary[1]["digest"]
    assert summary[0]["steps"] == summary[1]["steps"] == STEPS
    losses: dict[int, float] = {}
    for g in (0, 1):
        for e in run.committed(g):
            assert e["participants"] == 2, e
            assert losses.setdefault(e["step"], e["loss"]) == e["loss"], e  # the two groups agree
    assert sorted(losses) == list(range(1, STEPS + 1))

    # the plans: every step once, no prompt twice, each a group the service wrote and never got back
    plans = PlanLog(stack.store_url, stack.run_id, signing_key=stack.verify_key)
    recorded = [plans.get(s) for s in range(1, STEPS + 1)]
    trained = [(g["item"]["index"], g["trajectories"]) for p in recorded for g in p["groups"]]
    indices = [i for i, _ in trained]
    assert len(indices) == len(set(indices)) == STEPS * GROUPS
    q = GroupQueue(stack.store_url, stack.run_id)
    st = q.state("rollouts-0")
    written = {(d["item"]["index"], json.dumps(d["trajectories"])): (d["item"]["index"], d["attempt"])
               for d in q.read_groups("rollouts-0", 0, limit=10 ** 6)[0] if isinstance(d, dict)}
    for index, trajectories in trained:
        key = written.get((index, json.dumps(trajectories)))
        assert key is not None and key in st.landed and key not in st.failed, (index, key)
    claimed = {i for i, _ in st.claims}
    assert claimed == set(range(max(claimed) + 1))  # no prompt skipped across the service's restarts

    # the versions and the engines
    checked = list(verify_run(stack.store_url, stack.run_id, signing_key=stack.verify_key))
    assert checked and all(status == "ok" for _, status, _ in checked), checked
    assert checked[-1][0] == final
    assert exact and all(exact.values()), (exact, stack.checked)

    # the offline replay of the recorded plans on two ranks: the same loss at every step, the same weights
    plans_file = tmp_path / "recorded-plans.jsonl"
    plans_file.write_text("".join(json.dumps(p) + "\n" for p in recorded))
    replay = subprocess.run([sys.executable, "-m", "syncd.trainer.run", "--nproc", "2", "--model",
                             str(stack.model_dir), "--store", stack.store_url, "--run-id", stack.run_id, "--plans",
                             str(plans_file), "--steps", str(STEPS), "--groups-per-step", str(GROUPS),
                             *ElasticRun.FLAGS, "--out", str(tmp_path / "replay"), "--no-plot"],
                            env=stack.env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert replay.returncode == 0, replay.stderr[-4000:]
    replayed = {ln["step"]: ln["loss"] for ln in read_lines(tmp_path / "replay" / "metrics.jsonl")
                if ln.get("kind") == "step"}
    assert replayed == losses
    assert json.loads(replay.stdout.strip().splitlines()[-1])["digest"] == summary[0]["digest"]
