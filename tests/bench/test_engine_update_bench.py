"""bench.engine_update runs end to end on a tiny model (real publisher, store, engine, load) and writes
complete, self-consistent JSON."""

from __future__ import annotations

import json

import pytest

from bench import engine_update


@pytest.mark.slow
def test_engine_update_benchmark_tiny(tmp_path, capsys):
    out = tmp_path / "engine_update.json"
    png = tmp_path / "engine_update.png"
    assert engine_update.main(["--preset", "tiny", "--updates", "2", "--window", "0.5", "--json", str(out),
                               "--plot", str(png), "--delta-format", "2"]) == 0
    printed = capsys.readouterr().out
    assert "reload / stall" in printed and "physical limit" in printed and "0 lost" in printed
    assert "stage / decode" in printed
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"plot written to {png}" in printed
    data = json.loads(out.read_text())
    r = data["result"]
    assert data["bench"] == "engine_update" and [u["version"] for u in r["updates"]] == [1, 2]
    assert len(r["reload_s"]) == 2 and r["load_full_s"] and len(r["quiet_apply_s"]) == 2  # the plot's samples
    assert r["requests_lost"] == 0 and r["requests_completed"] == r["requests_submitted"] > 0
    assert all(u["changed"] > 0 and u["lines"] > 0 and 0 < u["stall_s"] < 60 for u in r["updates"])
    assert r["stall_max_s"] >= r["stall_median_s"] > 0 and r["reload_load_state_dict_median_s"] > 0
    assert r["tokens_per_s_baseline"] > 0 and r["tokens_per_s_with_updates"] > 0
    assert 0 < r["density"] < 1 and 0 < r["lines_touched_fraction"] <= 1
    assert r["quiet_apply_median_s"] > 0 and r["quiet_rollback_median_s"] > 0 and r["ratio_reload_to_quiet_apply"] > 0
    assert r["delta_format"] == 2 and r["quiet_stage_median_s"] > 0 and r["decode_changes_median_s"] > 0


def test_engine_update_benchmark_cuda_without_cuda_fails_clearly(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available: --device cuda runs (test_engine_update_benchmark_tiny_on_the_gpu)")
    out = tmp_path / "engine_update.json"
    with pytest.raises(SystemExit) as exc:
        engine_update.main(["--preset", "tiny", "--device", "cuda", "--json", str(out)])
    assert exc.value.code not in (0, None)
    err = capsys.readouterr().err
    assert "--device cuda: CUDA is not available" in err
    assert not out.exists()


@pytest.mark.gpu
@pytest.mark.slow
def test_engine_update_benchmark_tiny_on_the_gpu(tmp_path, capsys):
    import torch

    out = tmp_path / "engine_update_gpu.json"
    assert engine_update.main(["--preset", "tiny", "--updates", "2", "--window", "0.5", "--device", "cuda",
                               "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "reload / stall" in printed and "physical limit" in printed and "0 lost" in printed
    assert "pinned" in printed and "already on the GPU" in printed
    data = json.loads(out.read_text())
    r = data["result"]
    assert data["device"] == r["device"] == "cuda" and data["gpu"] == r["gpu_name"] == torch.cuda.get_device_name()
    assert r["requests_lost"] == 0 and r["requests_completed"] == r["requests_submitted"] > 0
    assert all(0 < u["stall_s"] < 60 and u["h2d_bytes"] > 0 and u["lines"] > 0 for u in r["updates"])
    for k in ("reload_load_state_dict_median_s", "reload_host_pinned_median_s", "reload_device_median_s",
              "engine_load_full_median_s", "h2d_pinned_bytes_per_s", "h2d_pageable_bytes_per_s",
              "device_copy_bytes_per_s", "delta_h2d_bytes_median", "touched_bytes_median", "limit_reload_host_s",
              "limit_reload_device_s", "limit_apply_s", "physical_limit_ratio", "physical_limit_ratio_device_reload",
              "ratio_reload_to_stall", "ratio_pinned_reload_to_stall", "ratio_device_reload_to_stall"):
        assert r[k] > 0, k
    assert len(r["reload_host_pageable_s"]) == len(r["reload_host_pinned_s"]) == len(r["reload_device_s"]) > 0
    assert r["physical_limit_basis"].startswith("PCIe")
