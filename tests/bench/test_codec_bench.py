"""bench.codec runs end to end on a tiny model and writes complete, self-consistent JSON."""

from __future__ import annotations

import json

from bench import codec


def test_codec_benchmark_tiny(tmp_path, capsys):
    out = tmp_path / "codec.json"
    assert codec.main(["--preset", "tiny", "--lrs", "1e-5", "--ks", "1,2", "--repeats", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "x bound" in printed and "zstd xor%" in printed
    data = json.loads(out.read_text())
    assert [r["k"] for r in data["results"]] == [1, 2]
    for r in data["results"]:
        assert 0 < r["density"] < 1
        assert r["encoded_bytes"] > 0 and r["bound_bytes"] > 0
        assert r["numpy_read_gbps"] > 0 and r["encode_gbps"] > 0 and r["apply_gbps"] > 0
        assert r["encode_vs_read_limit"] > 0 and r["apply_vs_read_limit"] > 0 and r["encode_changes_per_s"] > 0
        assert set(r["baselines"]) == {"zstd_full", "zstd_xor", "idx32_bf16_zstd", "gapvarint_zigzag_zstd"}
        # lossless and never worse than sending the bf16 weights through zstd
        assert r["encoded_bytes"] < r["baselines"]["zstd_full"]["bytes"]
    assert data["results"][1]["density"] >= data["results"][0]["density"]
