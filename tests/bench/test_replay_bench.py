"""bench.replay runs end to end with tiny arguments (real rollouts through Dynamo and the proxy with an update
mid-trajectory, MoE and NVFP4 QAT, kept sets recorded to be rebuilt) and writes complete, self-consistent JSON and a
PNG."""

from __future__ import annotations

import json
import os
import statistics

import pytest

from bench import replay

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_replay_benchmark_tiny(tmp_path, capsys):
    out, png = tmp_path / "replay.json", tmp_path / "replay.png"
    assert replay.main(["--preset", "tiny", "--models", "moe,nvfp4", "--json", str(out), "--plot", str(png)]) == 0
    printed = capsys.readouterr().out
    assert "kept-set + routing replay" in printed and "the lm_head forward matmul alone" in printed and "bytes per token of kept sets" in printed
    data = json.loads(out.read_text())
    assert [m["model"] for m in data["mismatch"]] == ["moe", "nvfp4"]
    for m in data["mismatch"]:
        rows = {r["row"]: r for r in m["rows"]}
        full = rows["kept-set + routing replay" if m["model"] == "moe" else "full replay (NVFP4 QAT trainer)"]
        none = rows["no replay" if m["model"] == "moe" else "no replay (NVFP4 QAT trainer)"]
        assert full["tokens"] == none["tokens"] == m["tokens"] == 48 and m["versions"] == [0, 1]
        assert abs(full["is_mean"] - 1) < 1e-4 and full["max_abs_dlogp"] <= 1e-4 and full["outside_pct"] == 0
        assert none["outside_pct"] > 30 and none["kl_k3"] > 1e-3  # the gap without replay, shown honestly
        assert rows["engine shapes (stepwise)"]["max_abs_dlogp"] <= 1e-4
        assert rows["newest weights, full replay"]["max_abs_dlogp"] > full["max_abs_dlogp"]  # staleness shows
        if m["model"] == "moe":
            assert full["routing_disagreement"] == 0.0 and 0 <= none["routing_disagreement"] <= 1
        comps = m["sources"]["components"]
        assert comps["kept_set"]["mean"] < 0
        assert abs(sum(c["mean"] for c in comps.values()) - m["sources"]["total"]["mean"]) < 1e-9
        assert m["bytes"]["tokens"] == 48 and 0 < m["bytes"]["kept_per_token"] < m["bytes"]["kept_listed_v1_per_token"]
        rb = m["rebuild"]  # the table replayed sets rebuilt from the recomputed logits, every one verified
        assert rb["rebuilt"] == rb["pending"] > 0 and rb["mismatches"] == 0
    (op,) = data["op"]
    assert op["rows"] == 64 and op["vocab"] == 4096 and op["kept_ids"] >= 64
    for part in ("op", "with_lm_head"):
        assert set(op[part]) == {"cpu", "cpu, sparse grad", "naive"} | ({"reference"} if part == "op" else set())
        assert all(r["s"] > 0 and r["speedup"] > 0 for r in op[part].values() if "speedup" in r)
    assert op["lm_head_s"] > 0 and op["lm_head_fraction"]["cpu"] > 0
    pk = data["bytes"]["public"]
    assert 1 <= pk["kept_size"]["median"] <= 3 and 30 < pk["kept_size"]["single_pct"] < 60 and pk["tokens"] == 96
    assert pk["int32_ids_per_token"] > pk["listed_v1_per_token"] >= pk["listed_bound_per_token"] > 8
    for d, r in pk["by_tolerance"].items():
        assert r["rebuilt_within"] > 0 and r["rebuilt_within_exact"] == r["rebuilt_within"] and r["beyond_wrong"] == 0
        assert 0 < r["per_token"] < pk["listed_v1_per_token"] and abs(sum(r["forms_pct"].values()) - 100) < 1e-6
    assert pk["by_tolerance"]["0.001"]["per_token"] <= 8  # the goal, at the default tolerance
    assert pk["op"]["rows"] == 64 and pk["op"]["rebuilt_verified"] == pk["op"]["rebuilt_rows"] > 0
    assert pk["op"]["rebuild_s"] > 0 and pk["op"]["kept_logprobs_cpu_s"] > 0
    routes = data["bytes"]["routes"]
    assert routes["per_token"] == 48 * 8 * 7 / 8 and routes["int32_per_token"] == 48 * 8 * 4
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_replay_benchmark_on_vllm_tiny(tmp_path, capsys):
    """``--engine vllm``: vLLM beside the reference engine on the same streams and update, every replay mode's row,
    recording's cost as paired rounds on the tiny model and on the ``speed`` model, the records' bytes."""
    if os.environ.get("SYNCD_VLLM") == "off":
        pytest.skip("SYNCD_VLLM=off: the vllm extra is not installed on this machine")
    out = tmp_path / "replay-vllm.json"
    assert replay.main(["--engine", "vllm", "--preset", "tiny", "--models", "dense", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "recording off" in printed and "paired ratios" in printed
    data = json.loads(out.read_text())
    [m] = data["models"]
    rows = {(r["engine"], r["replay"]): r for r in m["rows"]}
    assert set(rows) == {(e, mode) for e in ("vllm", "reference") for mode in ("none", "kept", "full")}
    for e in ("vllm", "reference"):
        kept, none = rows[e, "kept"], rows[e, "none"]
        assert kept["tokens"] == none["tokens"] == 48 and kept["is_outside_frac"] == 0 < none["is_outside_frac"]
        assert abs(kept["is_mean"] - 1) < 1e-3 and kept["max_abs_dlogp"] < 1e-3 < none["max_abs_dlogp"]
    for rec in (m["recording"], data["speed"]["recording"]):
        assert len(rec["pair_ratios"]) == len(rec["on"]["rounds"]) == len(rec["off"]["rounds"]) >= 1
        assert rec["ratio"] == statistics.median(rec["pair_ratios"]) > 0
        assert rec["worker"]["processor_calls"] > 0 and rec["worker"]["written"] > 0 and rec["on"]["tokens"] == 48
    assert data["speed"]["params"] > 0 and m["bytes"]["vllm"]["bytes_per_token"] > 0
