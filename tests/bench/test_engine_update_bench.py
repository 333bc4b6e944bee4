"""bench.engine_update runs end to end on a tiny model (real publisher, store, engine, load) and writes
complete, self-consistent JSON."""

from __future__ import annotations

import json

import pytest

from bench import engine_update


@pytest.mark.slow
def test_engine_update_benchmark_tiny(tmp_path, capsys):
    out = tmp_path / "engine_update.json"
    assert engine_update.main(["--preset", "tiny", "--updates", "2", "--window", "0.5", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "reload / stall" in printed and "physical limit" in printed and "0 lost" in printed
    data = json.loads(out.read_text())
    r = data["result"]
    assert data["bench"] == "engine_update" and [u["version"] for u in r["updates"]] == [1, 2]
    assert r["requests_lost"] == 0 and r["requests_completed"] == r["requests_submitted"] > 0
    assert all(u["changed"] > 0 and u["lines"] > 0 and 0 < u["stall_s"] < 60 for u in r["updates"])
    assert r["stall_max_s"] >= r["stall_median_s"] > 0 and r["reload_load_state_dict_median_s"] > 0
    assert r["tokens_per_s_baseline"] > 0 and r["tokens_per_s_with_updates"] > 0
    assert 0 < r["density"] < 1 and 0 < r["lines_touched_fraction"] <= 1
    assert r["quiet_apply_median_s"] > 0 and r["quiet_rollback_median_s"] > 0 and r["ratio_reload_to_quiet_apply"] > 0
