"""``syncd.trainer.ft.plan_log``: the elastic job's plans are written once (a second writer gets the first plan), read
back as hostile input (another step's entry, a malformed one, a forged one under a key are refused with the reason), and
waited for with a stated timeout."""

from __future__ import annotations

import json

import pytest

from syncd.trainer.ft.plan_log import PlanLog, PlanLogError

PLAN = {"kind": "plan", "step": 1, "version": 0, "groups": [{"gid": 3, "item": {"index": 3}}]}


def test_the_first_plan_of_a_step_wins_and_reads_back(tmp_path):
    store = f"file://{tmp_path}"
    a, b = PlanLog(store, "run"), PlanLog(store, "run")
    assert a.put(1, PLAN) == PLAN
    assert b.put(1, {**PLAN, "groups": []}) == PLAN  # a restarted live side retrains step 1 on the logged plan
    assert PlanLog(store, "run").get(1) == PLAN and PlanLog(store, "run").get(2) is None
    with pytest.raises(TimeoutError, match="no plan for step 2 in the plan log after 0 s"):
        b.wait(2, 0.1)


def test_entries_are_hostile_until_verified(tmp_path, monkeypatch):
    store = f"file://{tmp_path}"
    monkeypatch.setenv("SYNCD_SIGNING_KEY", "k" * 32)
    PlanLog(store, "run").put(1, PLAN)
    key = tmp_path / "runs" / "run" / "trainer" / "plans"
    raw = json.loads((key / "000000000001.json").read_text())
    (key / "000000000002.json").write_text(json.dumps(raw))  # step 1's entry copied to step 2
    with pytest.raises(PlanLogError, match="not the plan of step 2"):
        PlanLog(store, "run").get(2)
    raw["plan"]["groups"] = []
    (key / "000000000001.json").write_text(json.dumps(raw))  # a changed plan under the old signature
    with pytest.raises(PlanLogError, match="signature"):
        PlanLog(store, "run").get(1)
    (key / "000000000003.json").write_text("{\"step\": 3, \"plan\": ")
    with pytest.raises(PlanLogError):
        PlanLog(store, "run").get(3)
