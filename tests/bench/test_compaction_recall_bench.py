"""bench.compaction_recall runs end to end at a tiny size (a short warm-up, a real Dynamo frontend and reference engine
with a 64-token window, one chat-compacting sandbox proxy per arm) and writes the figures bench.agent reports as its
``compaction`` member; every training sample of every compacted arm is prefix-consistent. Whether the summary arm
wins is the benchmark's figure, not this test's."""

from __future__ import annotations

import json

import pytest

from bench import agent, compaction_recall

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_compaction_recall_benchmark_tiny(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = compaction_recall.main(["--requests", "3", "--warmup-steps", "10", "--hidden", "32", "--key-length", "1",
                                 "--json", str(out)])
    assert rc in (0, 1)  # 1: the reference check failed (a 10-step warm-up need not win)
    assert "margin over the better ablation" in capsys.readouterr().out
    r = json.loads(out.read_text())
    c = agent.compaction_figures(r)
    for k in ("success_summary", "success_empty_summary", "success_truncation", "success_full_context", "margin"):
        assert 0 <= c[k] <= 1 or k == "margin", (k, c[k])
    assert c["requests"] == 3 and c["warm_up"]["steps"] == 10
    assert c["prefix_consistent_frac"] == 1.0
    p = r["prefix_consistent"]
    assert set(p) == {"summary", "empty_summary", "truncation"}
    assert p["summary"]["samples"] == 2 * 3 and p["empty_summary"]["samples"] == p["truncation"]["samples"] == 3
    assert all(r["arms"][a]["compactions_mean"] == 1.0 for a in p) and r["arms"]["full_context"]["compactions_mean"] == 0
    lo, hi = r["task"]["prompt_tokens"]
    assert r["task"]["budget"] <= lo <= hi < 64  # compacted before the answer, uncompacted it fits


def test_settings_that_leave_no_task_are_refused():
    assert compaction_recall.main(["--window", "16", "--warmup-steps", "0"]) == 2
    assert compaction_recall.main(["--keys", "a1", "--warmup-steps", "0"]) == 2
