"""Who runs the live side of an elastic job (``syncd.trainer.rl.leadership``) and how a follower takes it over
(``syncd.trainer.rl.plans.LoggedPlans.take_over``), on a file store: one winner per term, a leader is gone only
once its heartbeat stops (or it is this group's own earlier life), a deposed leader learns it, hostile claims are
ignored, and a takeover starts from the newest logged RL state with every plan logged after it accounted for."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from syncd.trainer.ft.plan_log import LiveStateLog, PlanLog
from syncd.trainer.rl.leadership import Deposed, Leadership
from syncd.trainer.rl.plans import LoggedPlans

TIMEOUT_S, BEAT_S = 1.2, 0.1


@pytest.fixture
def store(tmp_path):
    return f"file://{tmp_path / 'store'}"


def _lead(store, group, **kw):
    return Leadership(store, "run", group, timeout_s=TIMEOUT_S, beat_s=BEAT_S, **kw)


def _until(cond, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_of_groups_claiming_one_term_at_once_exactly_one_leads_it(store):
    leads = [_lead(store, g) for g in range(6)]
    won = []
    gate = threading.Barrier(len(leads))

    def claim(lead):
        gate.wait()
        if lead.claim():
            won.append(lead.group)

    threads = [threading.Thread(target=claim, args=(ld,)) for ld in leads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert len(won) == 1
        term, doc = leads[0].newest()
        assert term == 1 and doc["group"] == won[0]
    finally:
        for ld in leads:
            ld.close()


def test_a_fresh_jobs_group_0_claims_at_once_and_a_follower_waits_for_a_beating_leader(store):
    follower = _lead(store, 1)
    assert not follower.may_claim_at_start()
    assert not follower.leader_gone()  # nobody claimed yet, but the timeout has not passed
    leader = _lead(store, 0)
    assert leader.may_claim_at_start() and leader.claim()
    try:
        t_end = time.monotonic() + 3 * TIMEOUT_S
        while time.monotonic() < t_end:  # a beating leader is never gone
            assert not follower.leader_gone()
            time.sleep(0.05)
        assert not _lead(store, 0).may_claim_at_start()  # a term exists: group 0 restarted waits like the others
    finally:
        leader.close()
    _until(follower.leader_gone, 3 * TIMEOUT_S)  # its heartbeat stopped
    assert follower.claim() and follower.newest()[0] == 2
    follower.close()


def test_nobody_claimed_within_the_timeout_lets_any_group_claim(store):
    follower = _lead(store, 2)
    _until(follower.leader_gone, 3 * TIMEOUT_S)
    assert follower.claim()
    follower.close()


def test_a_restarted_leader_knows_its_earlier_life_is_gone(store):
    first = _lead(store, 3)
    assert first.claim()
    first._stop.set()  # killed: the beats stop (the object stays)
    again = _lead(store, 3)
    assert again.leader_gone()  # at once, not after the timeout
    assert not _lead(store, 4).leader_gone()


def test_a_deposed_leader_learns_it_within_a_beat_or_two(store):
    old = _lead(store, 0)
    assert old.claim()
    old.check()
    new = _lead(store, 1)
    assert not new.leader_gone()  # it has seen term 1 ...
    assert new.claim() and new.term == 2  # ... and claims the next on a false suspicion: the old leader beats
    _until(lambda: old._deposed.is_set(), 5.0)
    with pytest.raises(Deposed, match="newer term"):
        old.check()
    old.close()
    new.close()


def test_the_publish_fence_looks_at_the_store_itself(store):
    old = _lead(store, 0)
    assert old.claim()
    old._stop.set()  # its heartbeat thread would notice within a beat: the fence must not wait for it
    old._thread.join()
    old.fence()
    new = _lead(store, 1)
    assert not new.leader_gone() and new.claim()
    with pytest.raises(Deposed):
        old.fence()
    new.close()


def test_a_malformed_claim_is_ignored_and_counted(store):
    lead = _lead(store, 0)
    lead.store.put("runs/run/trainer/leaders/000000000007.json", b'{"term": 7, "group": "x"}')
    lead.store.put("runs/run/trainer/leaders/000000000008.json", b"\xff not json")
    lead.store.put("runs/run/trainer/leaders/notes.txt", b"ignored")
    assert lead.newest() is None and lead.counts["bad_objects"] == 2
    assert lead.claim() and lead.newest()[0] == 1  # the malformed ones are no term
    lead.close()


def test_a_takeover_starts_from_the_newest_state_and_accounts_for_every_later_plan(store):
    plans, states = PlanLog(store, "run"), LiveStateLog(store, "run")
    for s in range(1, 6):
        plans.put(s, {"step": s, "groups": [{"item": {"index": 10 * s}}]})
    for s in (2, 3):
        states.put(s, {"step": s, "version": s, "buffer": None})
    started = []

    def make_live(state_step, state, settled):
        started.append((state_step, state, settled))
        return SimpleNamespace(plan=lambda step: {"step": step, "groups": []})

    lead = _lead(store, 1)
    lp = LoggedPlans(SimpleNamespace(plans=None, rollout_timeout_s=5.0), plans, 0, lead=lead, states=states,
                     make_live=make_live)
    assert lp.live is None
    lp.take_over(6)
    (state_step, state, settled), = started
    assert state_step == 3 and state == {"step": 3, "version": 3, "buffer": None}
    assert [p["step"] for p in settled] == [4, 5] and lp.accounted == 5
    assert lp.get(6) == {"step": 6, "groups": []} and plans.get(6) == {"step": 6, "groups": []}


def test_a_takeover_without_any_logged_state_after_step_1_is_refused(store):
    plans = PlanLog(store, "run")
    plans.put(1, {"step": 1, "groups": []})
    lp = LoggedPlans(SimpleNamespace(plans=None, rollout_timeout_s=5.0), plans, 0, lead=_lead(store, 1),
                     states=LiveStateLog(store, "run"), make_live=lambda *a: pytest.fail("started"))
    with pytest.raises(RuntimeError, match="no live state"):
        lp.take_over(2)
