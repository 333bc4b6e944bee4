"""bench.cache_verify runs end to end on the tiny preset and writes complete, self-consistent JSON."""

from __future__ import annotations

from bench import cache_verify
from tests.bench._run import run_bench


def test_cache_verify_benchmark_tiny(tmp_path, capsys):
    data, printed = run_bench(cache_verify, ["--preset", "tiny", "--rounds", "1"], tmp_path, capsys)
    assert "read pass (the limit)" in printed and "with re-hashed shards" in printed
    tp, up = data["throughput"], data["update"]
    assert tp["bytes"] == 16 << 20 and all(v > 0 for v in tp["gbps"].values())
    assert 0 < tp["vs_read"]["read_sha256"] and 0 < tp["vs_read"]["parallel_verified"]
    assert 0 < up["delta_bytes"] < up["full_bytes"] and up["stage_apply_s"] > 0 and up["hash_s_expected"] > 0
