"""``syncd train`` (``python -m syncd.trainer.run``, a real process on real files) against records that cannot be
trained on as recorded, from a stand-in for the serving side that writes them in the project's own formats
(``tests/trainer/rl/_record_stand_in.py``: reference engines on the run's newest version, a replay recorder, the
trajectory records). Each run must finish (exit 0) with the bad group dropped, counted, and its prompt regenerated
and trained:

* one NaN engine log-prob in a replay record (before: the training step raised ValueError, and every ``--resume`` put
  the same group back and died again);
* records claiming a version that was never published (before: trained as fresh);
* engines recording kept sets to rebuild (``--replay-kept-tolerance``) under ``--top-p``/``--top-k``, with groups a
  version behind (before: the first such group raised KeptRebuildError: the loop never resolved the sets).
"""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from syncd.engine.reference.make_tiny import write_model
from syncd.trainer.rl.metrics import read_metrics
from tests.trainer.rl._record_stand_in import RecordingStandIn

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("hostile-model") / "tiny", hidden=32)


def _train(tmp_path, model_dir, monkeypatch, *flags, tamper=None, tolerance=None, steps=3) -> dict:
    key = "hex:" + secrets.token_hex(32)
    monkeypatch.setenv("SYNCD_SIGNING_KEY", key)  # the stand-in reads the trainer's versions with it
    store = (tmp_path / "store").as_uri()
    out = tmp_path / "out"
    stand = RecordingStandIn(model_dir, store, "rl", kept_tolerance=tolerance, tamper=tamper)
    argv = [sys.executable, "-m", "syncd.trainer.run", "--model", str(model_dir), "--store", store, "--run-id", "rl",
            "--proxy", stand.url, "--out", str(out), "--steps", str(steps), "--groups-per-step", "2",
            "--group-size", "2", "--task-length", "4", "--no-plot", *flags]
    try:
        p = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900,
                           env={**__import__("os").environ, "SYNCD_SIGNING_KEY": key, "OMP_NUM_THREADS": "1"})
    finally:
        stand.close()
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-6000:]
    plans = [json.loads(ln) for ln in (out / "plans.jsonl").read_text().splitlines()]
    return {"summary": json.loads(p.stdout.strip().splitlines()[-1]), "plans": plans, "stderr": p.stderr,
            "steps": [ln for ln in read_metrics(out / "metrics.jsonl") if ln["kind"] == "step"], "stand": stand}


def _trained(plans, index):
    """The trajectory ids of every trained group of prompt ``index``."""
    return [t for p in plans for g in p["groups"] if g["item"]["index"] == index for _, t in g["trajectories"]]


def test_a_nan_log_prob_costs_its_group_not_the_run(tmp_path, model_dir, monkeypatch):
    lie = {"logprob_at": 1, "logprob": float("nan")}
    run = _train(tmp_path, model_dir, monkeypatch, tamper=lambda tid: lie if tid.endswith("-g000000-s00") else None)
    assert run["steps"][-1]["rollout_failures"].get("replay", 0) >= 1, run["steps"][-1]
    assert "NonFiniteError" in run["stderr"] and "log-prob nan in the replay record" in run["stderr"]
    trained = _trained(run["plans"], 0)
    assert trained and all(re.search(r"-g000000r\d+-s0\d$", t) for t in trained), trained  # regenerated, then trained
    assert len(run["plans"]) == 3


def test_records_of_a_version_never_published_are_refused(tmp_path, model_dir, monkeypatch):
    lie = {"version": 7}  # 6 steps: the refused group goes back to the rollout service and its prompt comes again
    run = _train(tmp_path, model_dir, monkeypatch, tamper=lambda tid: lie if tid.endswith("-g000001-s00") else None,
                 steps=6)
    assert run["summary"]["refused_groups"] == {"UnpublishedVersionError": 1}, run["summary"]
    assert "claim version 7, which the trainer never published" in run["stderr"]
    trained = _trained(run["plans"], 1)
    assert trained and all(re.search(r"-g000001r\d+-s0\d$", t) for t in trained), trained
    for plan in run["plans"]:  # no trained token is newer than the trainer's version
        assert all(int(v) <= plan["version"] for g in plan["groups"] for v in g["versions"]), plan


def test_kept_sets_to_rebuild_are_resolved_for_groups_a_version_behind(tmp_path, model_dir, monkeypatch):
    """``letters`` in groups of 4: rewards differ within a group, so every step moves the weights (with equal rewards
    the advantages are 0, the weights stay, and a stale group's sets still rebuild from the trainer's own logits)."""
    run = _train(tmp_path, model_dir, monkeypatch, "--top-p", "0.9", "--top-k", "20", "--max-lag", "2", "--task",
                 "letters", "--group-size", "4", tolerance=1e-3, steps=4)
    assert all(s["grad_norm"] > 0 for s in run["steps"]), [s["grad_norm"] for s in run["steps"]]
    resolved = run["summary"]["rollouts"]["kept_resolved"]
    assert resolved["sequences"] >= 2 * 4 * 4 and resolved["versions_loaded"] >= 2, resolved
    behind = [g for p in run["plans"] for g in p["groups"] if min(map(int, g["versions"])) < p["version"]]
    assert behind, [(p["version"], [g["versions"] for g in p["groups"]]) for p in run["plans"]]
    assert not run["summary"]["refused_groups"] and not run["steps"][-1]["rollout_failures"]


def test_a_checkpoint_holding_a_poisoned_group_resumes_without_it(tmp_path, model_dir):
    """A checkpoint an older trainer wrote with the NaN group in its buffer: on resume the group is read back, refused
    (NonFiniteError), dropped and its prompt regenerated -- where every --resume used to put it back and die again."""
    import time

    from syncd.trainer.rl.group_reader import GroupReader
    from syncd.trainer.rl.rl_state import PromptLedger, restore_groups
    from syncd.trainer.rl.rollout_workers import complete
    from syncd.trainer.rl.tasks import get_task

    store = (tmp_path / "store").as_uri()
    lie = {"logprob_at": 2, "logprob": float("nan")}
    stand = RecordingStandIn(model_dir, store, "rl", signing_key=False, tamper=lambda t: lie if t == "old-s1" else None)
    task = get_task("repeat", length=4)
    item = task.item(0, 0)
    try:
        for j, tid in enumerate(("old-s0", "old-s1")):
            complete(stand.url, {"model": "tiny", "prompt": item.prompt, "max_tokens": 4, "seed": j}, tid)
            stand._finish(tid, {"reward": 0.5})
        reader = GroupReader(store, "rl", vocab_size=320, record_timeout_s=5)  # what the trainer reads back with
        ledger = PromptLedger()
        index, _ = ledger.next_prompt()
        ledger.started(index, {})
        ledger.landed(index)
        doc = {"gid": 0, "item": {"index": 0, "prompt": item.prompt, "target": item.target, "meta": item.meta},
               "trajectories": [["sb", "old-s0"], ["sb", "old-s1"]], "rewards": [0.5, 0.5], "versions": {"0": 8},
               "tokens": 8, "requested_version": 0, "requested_at": time.time(), "finished_at": time.time(),
               "token_versions": None, "attempt": 0}
        got, groups, report = restore_groups({"ledger": ledger.snapshot(), "groups": [doc]}, version=1, max_lag=2,
                                             newest_published=1, reread=reader.reread, recover=lambda i, e: None)
    finally:
        stand.close()
    assert report.dropped_mismatch == [0] and not groups and list(got.retry) == [0], report
