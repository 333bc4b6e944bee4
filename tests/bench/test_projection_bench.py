"""bench.projection measures its rates on tiny deltas and writes a complete stage table for every density,
kind and format, with its assumptions, the goal line and a plot."""

from __future__ import annotations

import json

import pytest

from bench import projection


def _run(tmp_path, capsys, *extra):
    out, png = tmp_path / "projection.json", tmp_path / "projection.png"
    assert projection.main(["--sample-mib", "2", "--densities", "0.01,0.1", "--repeats", "1", "--json", str(out),
                            "--plot", str(png), *extra]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out, png


def test_projection_tiny(tmp_path, capsys):
    data, printed, png = _run(tmp_path, capsys, "--hop-overhead-s", "0.005", "--long-gbit", "10")
    assert "assumptions: params 1e+12" in printed and "long-gbit 10" in printed and "dominant" in printed
    assert "goal (1e+12 bf16 at 1% over 10 Gb/s, format 2)" in printed
    assert png.stat().st_size > 1000
    assert data["assumptions"]["long-gbit"] == 10 and data["broadcast"] == {"per_hop_s": 0.005, "assumed": True}
    assert len(data["measured"]) == 2 and len(data["projections"]) == 2 * 2 * 2
    for row in data["measured"]:
        assert row["density_measured"] == pytest.approx(row["density"], rel=0.2)
        for kind in ("bf16", "nvfp4"):
            for v in ("1", "2"):
                m = row[kind][v]
                assert m["bytes"] > 0 and m["encode_s"] > 0 and m["apply_s"] > 0 and m["host_decode_s"] > 0
        # format 2 codes bf16 smaller; NVFP4's codes (integers) and scales (8-bit floats) stay mode 0
        assert row["bf16"]["2"]["bytes"] < row["bf16"]["1"]["bytes"]
        assert row["bf16"]["2"]["class_bytes"] > 0 and row["nvfp4"]["2"]["class_bytes"] == 0
    for q in data["projections"]:
        st = q["stages_s"]
        assert set(st) == {"encode", "upload", "long link", "broadcast", "stage", "pause"}
        assert all(t >= 0 for t in st.values()) and q["dominant"] in st
        assert q["sequential_s"] == pytest.approx(sum(st.values()))
        # pipelining overlaps stages: between the longest one and their sum (the same sum in another order)
        assert max(st.values()) <= q["pipelined_s"] <= q["sequential_s"] * (1 + 1e-9)
        # every byte of the delta crosses the long link once
        assert st["long link"] == pytest.approx(q["delta_bytes"] * 8 / 10e9)
        assert q["tree_depth"] == 6  # 64 nodes, fanout 2
    goal = data["goal"]["case"]
    assert goal["kind"] == "bf16" and goal["format"] == 2 and goal["density"] == 0.01
    # denser updates move more bytes over the same links (the byte-bound stages; the measured rates of the
    # other stages are timings, which a busy machine can invert between two tiny runs)
    by = {(q["kind"], q["format"], q["density"]): q for q in data["projections"]}
    dense, sparse = by[("bf16", 2, 0.1)], by[("bf16", 2, 0.01)]
    assert dense["delta_bytes"] > sparse["delta_bytes"]
    assert dense["stages_s"]["long link"] > sparse["stages_s"]["long link"]


def test_format2_leaves_the_sliced_share_in_format1(tmp_path, capsys):
    """--sliced-fraction of the weights stay in format 1 when format 2 is chosen (engines cannot decode a sliced
    tensor's context blocks): format 2's delta is that mix of both formats' measured bytes."""
    data, _, _ = _run(tmp_path, capsys, "--hop-overhead-s", "0.005", "--densities", "0.01", "--sliced-fraction", "0.25")
    assert data["assumptions"]["sliced-fraction"] == 0.25
    row = data["measured"][0]["bf16"]
    by = {(q["kind"], q["format"]): q for q in data["projections"]}
    scale = by[("bf16", 1)]["delta_bytes"] / row["1"]["bytes"]
    mixed = 0.25 * row["1"]["bytes"] + 0.75 * row["2"]["bytes"]
    assert by[("bf16", 2)]["delta_bytes"] == pytest.approx(scale * mixed)
    assert projection.main(["--sliced-fraction", "1.5", "--json", str(tmp_path / "x.json")]) == 2
    assert "--sliced-fraction must be in [0, 1]" in capsys.readouterr().err


def test_tree_depth():
    assert [projection.tree_depth(n, 2) for n in (1, 2, 3, 4, 7, 8, 64)] == [0, 1, 1, 2, 2, 3, 6]
    assert projection.tree_depth(64, 4) == 3


@pytest.mark.integration
@pytest.mark.slow
def test_projection_measures_the_broadcast_hop(tmp_path, capsys):
    """Without --hop-overhead-s, the hop comes from bench.broadcast run on loopback in the same process."""
    data, printed, _ = _run(tmp_path, capsys, "--densities", "0.01")
    hop = data["broadcast"]
    assert set(hop["completion_s"]) == {"2", "4"} and hop["per_hop_s"] >= 0 and "assumed" not in hop
    assert "bench.broadcast, loopback" in printed
