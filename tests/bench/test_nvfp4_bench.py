"""bench.nvfp4 runs end to end with tiny arguments and writes complete, self-consistent JSON."""

from __future__ import annotations

from bench import nvfp4
from tests.bench._run import run_bench


def test_nvfp4_benchmark_tiny(tmp_path, capsys):
    data, printed = run_bench(nvfp4, ["--preset", "tiny", "--repeats", "1"], tmp_path, capsys)
    assert "quantize(pts)" in printed and "delta as % of the packed NVFP4 bytes" in printed
    tp = data["throughput"]
    assert tp["read_gbps"] > 0
    assert set(tp["backends"]) == {"cpu", "reference"}
    for r in tp["backends"].values():
        assert r["bit_exact"] is True
        assert r["quantize_gbps"] > 0 and r["quantize_pts_gbps"] > 0 and r["dequantize_gbps"] > 0
        assert r["dequantize_out_gbps"] > 0
        assert all(r[f"{op}_vs_read"] > 0 for op in ("quantize", "quantize_pts", "dequantize", "dequantize_out"))
    rows = data["deltas"]
    assert [r["k"] for r in rows] == [1, 2]
    for r in rows:
        assert r["packed_bytes"] > 0 and 0 < r["delta_bytes"]
        assert 0 < r["codes_changed_pct"] < 100 and 0 <= r["scales_changed_pct"] < 100
        assert r["packed_bytes"] < r["bf16_bytes"] / 3  # 4.5 bits against 16
    assert rows[1]["codes_changed_pct"] >= rows[0]["codes_changed_pct"]
