"""``bench.engine_update --engine vllm`` runs end to end on a tiny model (real publisher, store, a real vLLM on CPU,
load) and writes complete, self-consistent JSON."""

from __future__ import annotations

import json
import os

import pytest

from bench import engine_update

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def test_engine_update_benchmark_on_vllm_tiny(tmp_path, capsys):
    if os.environ.get("SYNCD_VLLM") == "off":
        pytest.skip("SYNCD_VLLM=off: the vllm extra is not installed on this machine")
    out = tmp_path / "engine_update.json"
    assert engine_update.main(["--engine", "vllm", "--preset", "tiny", "--updates", "2", "--window", "1",
                               "--json", str(out), "--plot", str(tmp_path / "vllm.png")]) == 0
    printed = capsys.readouterr().out
    assert "reload / pause" in printed and "physical limit" in printed and "0 lost" in printed
    data = json.loads(out.read_text())
    r = data["result"]
    assert data["engine"] == "vllm" and [u["version"] for u in r["updates"]] == [1, 2]
    assert r["requests_lost"] == 0 and r["requests_completed"] > 0
    assert all(u["changed"] > 0 and u["lines"] > 0 and 0 < u["stall_s"] <= u["pause_s"] < 60 for u in r["updates"])
    assert r["vllm_reload_pause_median_s"] > 0 and r["vllm_reload_worker_median_s"] > 0
    assert all(u["prepare_s"] > 0 for u in r["updates"])  # the linear layers are packed while staging
    assert (tmp_path / "vllm.png").stat().st_size > 0
    assert r["tokens_per_s_baseline"] > 0 and r["tokens_per_s_with_updates"] > 0 and r["physical_limit_ratio"] > 1
