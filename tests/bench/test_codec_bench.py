"""bench.codec runs end to end on a tiny model and writes complete, self-consistent JSON for both formats."""

from __future__ import annotations

from bench import codec
from tests.bench._run import run_bench


def test_codec_benchmark_tiny(tmp_path, capsys):
    png = tmp_path / "codec.png"
    data, printed = run_bench(codec, ["--preset", "tiny", "--lrs", "1e-5", "--ks", "1,2", "--repeats", "1", "--plot",
                                      str(png)], tmp_path, capsys)
    assert "v2/bnd" in printed and "zstd xor%" in printed and "format 2 against format 1" in printed
    assert png.stat().st_size > 1000
    assert [r["k"] for r in data["results"]] == [1, 2]
    for r in data["results"]:
        assert 0 < r["density"] < 1 and r["bound_bytes"] > 0 and r["numpy_read_gbps"] > 0
        assert r["encode_vs_read_limit"] > 0 and r["apply_vs_read_limit"] > 0
        assert set(r["baselines"]) == {"zstd_full", "zstd_xor", "idx32_bf16_zstd", "gapvarint_zigzag_zstd"}
        assert set(r["formats"]) == {"1", "2"}
        for f in r["formats"].values():
            assert f["encoded_bytes"] > 0 and f["encode_gbps"] > 0 and f["apply_gbps"] > 0
            assert f["encode_changes_per_s"] > 0 and f["encode_vs_v1"] > 0
            # lossless and never worse than sending the bf16 weights through zstd
            assert f["encoded_bytes"] < r["baselines"]["zstd_full"]["bytes"]
        assert r["formats"]["1"]["encode_vs_v1"] == 1.0
    assert data["results"][1]["density"] >= data["results"][0]["density"]
