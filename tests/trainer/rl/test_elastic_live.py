"""Elastic data parallelism on the live path, on real parts: the RL stack (``syncd.app.rl_stack``: reference-engine
workers under the Dynamo frontend, the sandbox proxy, the node daemon applying every version), ``syncd rollouts`` as
its own process feeding the run's queue, a torchft lighthouse, and two replica groups of ``syncd.trainer.run
--external-rollouts --lighthouse ...`` (one process each, checkpoints replicated to each other).

Replica group 0 leads (it runs the live side: the queue feed, the buffer, the plans, publishing). It is killed with
SIGKILL mid-run and its node's disk wiped. Asserted: group 1 trains on alone (the job shrinks), claims the next term
once group 0's heartbeat stops, takes the live side over from the logged RL state and publishes the next versions;
group 0, restarted with the same command line, rebuilds its state from the replica group 1 holds, heals to the live
step and follows (it does not take the live side back); both end with the same weights, every step committed once
by each life, the plan log holds every step once, no prompt is trained twice, every trained group is one the service
wrote and the trainer never sent back, versions only increase, and the engines end on the last one.
"""

from __future__ import annotations

import logging
import re
import time

import pytest

from bench.trainer_elastic import ElasticRun
from syncd.trainer.ft.plan_log import PlanLog
from syncd.trainer.rl.group_queue import GroupQueue
from syncd.trainer.rl.leadership import Leadership
from syncd.versions import verify_run

pytestmark = [pytest.mark.integration, pytest.mark.slow]

log = logging.getLogger(__name__)

#: long enough that the survivor still trains when the restarted group is back (a step of this tiny model takes a
#: fraction of a second; the restart is a warm spare's, its imports done before the kill)
STEPS, GROUPS = 64, 2


def test_the_live_side_moves_to_a_surviving_group_and_the_killed_group_regrows_from_replicas(tmp_path):
    run = ElasticRun(tmp_path, steps=STEPS, groups_per_step=GROUPS)
    stack = run.stack
    try:
        for g in (0, 1):
            run.start(g)
        spare = run.start(0, spare=True)
        run.wait("group 0 at step 4", lambda: any(e["step"] >= 4 for e in run.committed(0)), 0)
        held = run.node(1) / "group-1" / "held" / "group-0"
        run.wait("a replica of group 0 on group 1's node", lambda: held.exists() and any(held.iterdir()), 1)
        t_kill = run.kill(0)  # and its node's disk
        # group 1 trains on alone, and once group 0's heartbeat stopped it takes the live side over
        run.wait("group 1 leading", lambda: run.leading_since(1, t_kill), 1)
        t_restart = time.time()
        run.go(0, spare)
        summary = run.finish()
        stack.wait_engines_at(summary[1]["final_version"], timeout_s=120)
    finally:
        run.close()

    # the live side moved once, to the survivor; the restarted group follows
    term, doc = Leadership(stack.store_url, stack.run_id, 9).newest()
    assert (term, doc["group"]) == (2, 1), (term, doc)
    assert "took the live side over" in (tmp_path / "g1.0.err").read_text()

    # the job shrank, then regrew: group 1 trained alone after the kill, group 0 rebuilt from its replica and rejoined
    alone = [e for e in run.committed(1, t_kill) if e["participants"] == 1]
    assert alone, "group 1 never trained alone"
    restored = [e for e in run.events(0) if e["kind"] == "restored"][-1]
    assert restored["source"] == "group-1" and restored["step"] >= 1, restored
    back = run.committed(0, t_restart)
    assert back and all(e["participants"] == 2 for e in back), "the restarted group never rejoined"
    assert any(e["kind"] == "attempt" and e["healed"] for e in run.events(0) if e["t"] >= t_restart)
    log.warning("shrink %.1f s (kill to group 1's first step alone), regrow %.1f s (restart to group 0's first "
                "committed step)", alone[0]["t"] - t_kill, back[0]["t"] - t_restart)

    # one model, every step once per life
    assert summary[0]["digest"] == summary[1]["digest"]
    assert summary[0]["steps"] == summary[1]["steps"] == STEPS
    steps1 = [e["step"] for e in run.committed(1)]
    assert steps1 == list(range(steps1[0], STEPS + 1)), steps1
    steps0 = [e["step"] for e in back]
    assert steps0 == list(range(steps0[0], STEPS + 1)), steps0

    # the plan log: every step once, no prompt trained twice, each an attempt the service wrote and got back never
    plans = PlanLog(stack.store_url, stack.run_id, signing_key=stack.verify_key)
    trained = []
    for s in range(1, STEPS + 1):
        for g in plans.get(s)["groups"]:
            m = re.search(r"-g(\d{6})(?:r(\d+))?-s\d{2}$", g["trajectories"][0][1])
            assert m and int(m.group(1)) == g["item"]["index"], g["trajectories"]
            trained.append((g["item"]["index"], int(m.group(2) or 0)))
    assert plans.get(STEPS + 1) is None
    indices = [i for i, _ in trained]
    assert len(indices) == len(set(indices)) == STEPS * GROUPS
    st = GroupQueue(stack.store_url, stack.run_id).state("rollouts-0")
    for key in trained:
        assert key in st.landed and key not in st.failed, key

    # versions: group 0 published up to the kill, group 1 after; in the store one unbroken chain that verifies
    # deeply (every delta applied, every checksum compared), the engines on its last version
    pubs = sorted((ln["t"], g) for g in (0, 1) for ln in run.metrics(g) if ln.get("kind") == "publish")
    assert {g for t, g in pubs if t < t_kill} == {0} and {g for t, g in pubs if t > t_kill} == {1}, pubs
    checked = list(verify_run(stack.store_url, stack.run_id, signing_key=stack.verify_key))
    assert [v for v, _, _ in checked] == list(range(summary[1]["final_version"] + 1)), checked
    assert all(status == "ok" for _, status, _ in checked), checked
    assert summary[1]["final_version"] >= STEPS // 2
