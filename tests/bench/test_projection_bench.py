"""bench.projection measures its rates on tiny deltas and writes a complete stage table for every density, kind and
format, with its assumptions, the 1T figure and a plot; the projected times follow from the measured rates and the
assumptions, and grow with the density and the size (a busy machine once made a 10% update project faster than a
1% one)."""

from __future__ import annotations

import json

import pytest

from bench import _projection_model as model
from bench import projection


def _run(tmp_path, capsys, *extra):
    out, png = tmp_path / "projection.json", tmp_path / "projection.png"
    assert projection.main(["--sample-mib", "2", "--densities", "0.1,0.01", "--repeats", "1", "--json", str(out),
                            "--plot", str(png), *extra]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out, png


def test_projection_tiny(tmp_path, capsys):
    data, printed, png = _run(tmp_path, capsys, "--hop-overhead-s", "0.005", "--long-gbit", "10")
    assert "assumptions: params 1e+12" in printed and "long-gbit 10" in printed and "dominant" in printed
    assert "projection_1t_s (1e+12 bf16 at 1% over 10 Gb/s, format 1" in printed
    assert "validation error: not validated in this run" in printed
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
    a = projection.parser().parse_args(["--long-gbit", "10"])
    for q in data["projections"]:
        st = q["stages_s"]
        assert tuple(st) == model.STAGES and all(t >= 0 for t in st.values()) and q["dominant"] in st
        assert q["total_s"] == pytest.approx(sum(st.values()))  # one stage after another
        # the long link: half a poll, the manifest read and sent to the other 63 nodes, every delta byte once
        manifest, long, intra = model.manifest_estimate(1e12 / 16e6, q["shards"]), 10e9 / 8, 100e9 / 8
        wire = manifest / long + 63 * manifest / intra + q["delta_bytes"] / long
        assert st["long link"] == pytest.approx(0.5 + wire / model.TCP_PAYLOAD)
        assert st["upload"] > 0 and st["pause"] == q["pause_s"] and q["tree_depth"] == 6  # 64 nodes, fanout 2
    goal = data["goal"]["case"]
    assert goal["kind"] == "bf16" and goal["format"] == 1 and goal["density"] == 0.01
    assert data["projection_1t_s"] == goal["total_s"] and data["projection_1t"]["validation_error"] is None
    # the projected times were recomputed from the rates the JSON says they came from
    rows = {r["density"]: r for r in data["projected_from"]}
    again = {(q["kind"], q["format"], q["density"]): q for q in data["projections"]}
    for (kind, v, d), q in again.items():
        p = projection.project(rows[d], kind, str(v), a, data["host_rates"], 0.005)
        assert p["stages_s"] == pytest.approx(q["stages_s"])
    # denser updates never project faster, stage by stage (timings are made monotone in density)
    for kind in ("bf16", "nvfp4"):
        for v in (1, 2):
            sparse, dense = again[(kind, v, 0.01)], again[(kind, v, 0.1)]
            assert dense["delta_bytes"] > sparse["delta_bytes"] and dense["total_s"] > sparse["total_s"]
            worse = [s for s in model.STAGES if dense["stages_s"][s] < sparse["stages_s"][s]]
            assert not worse, (kind, v, worse, sparse["stages_s"], dense["stages_s"])
    # and a bigger model never projects faster either: in total, the publisher's whole time, and every later stage
    # (the upload stage alone is the tail after the encode: the last shards' upload, which a smaller model can
    # have as long as a bigger one -- equal up to rounding when the encode is slow)
    small = projection.parser().parse_args(["--long-gbit", "10", "--params", "1e11"])
    for (kind, v, d), q in again.items():
        p = projection.project(rows[d], kind, str(v), small, data["host_rates"], 0.005)
        ps, qs = p["stages_s"], q["stages_s"]
        assert p["total_s"] < q["total_s"]
        assert ps["encode"] + ps["upload"] <= (qs["encode"] + qs["upload"]) * (1 + 1e-9), (kind, v, d, ps, qs)
        worse = [s for s in model.STAGES if s not in ("encode", "upload") and ps[s] > qs[s] * (1 + 1e-9)]
        assert not worse, (kind, v, d, worse, ps, qs)


def test_engines_decoding_on_more_host_cores_stage_sooner():
    """--decode-cores-per-gpu: the GPU engines' host decode, the largest part of their stage at 1T, runs on that many
    cores per GPU process (at most the node's cores); nothing else changes."""
    r = model.Rates(delta_bytes_per_param=0.01, changed_per_param=0.01, encode=1e9, stage=1e9, decode=1e9, apply=1e9,
                    checksum=1e10, sha256=1e9, copy=1e10, finite=1e10)
    base = model.Setup(params=1e12, node_cores=32, gpus_per_node=8, gpus_per_engine=16)
    one, four, many = (model.stages(base.with_(decode_cores_per_gpu=c), r)["stages_s"] for c in (1, 4, 100))
    node_weights = 2e12 * 8 / 16
    assert one["stage"] - four["stage"] == pytest.approx(node_weights / 1e9 * (1 / 8 - 1 / 32))
    assert many["stage"] == pytest.approx(four["stage"])  # 32 cores is all the node has
    assert {k: v for k, v in one.items() if k != "stage"} == {k: v for k, v in four.items() if k != "stage"}


def test_monotone_keeps_the_slower_side():
    """A timing that drops at a higher density (noise) is raised to the lower density's, per weight byte."""
    def row(d, t):
        one = {"bytes": 10, "encode_s": t, "apply_s": t, "host_decode_s": t, "class_bytes": 0}
        return {"density": d, "bf16": {"weight_bytes": 100, "1": dict(one), "2": dict(one)},
                "nvfp4": {"weight_bytes": 50, "1": dict(one), "2": dict(one)}}

    got = projection.monotone([row(0.1, 1.0), row(0.01, 3.0), row(0.2, 5.0)])
    assert [r["density"] for r in got] == [0.01, 0.1, 0.2]
    assert [r["bf16"]["1"]["encode_s"] for r in got] == [3.0, 3.0, 5.0]
    assert [r["nvfp4"]["2"]["host_decode_s"] for r in got] == [3.0, 3.0, 5.0]


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


@pytest.mark.integration
@pytest.mark.slow
def test_projection_measures_the_broadcast_hop(tmp_path, capsys):
    """Without --hop-overhead-s, the hop comes from bench.broadcast run on loopback in the same process."""
    data, printed, _ = _run(tmp_path, capsys, "--densities", "0.01")
    hop = data["broadcast"]
    assert set(hop["completion_s"]) == {"2", "4"} and hop["per_hop_s"] >= 0 and "assumed" not in hop
    assert "bench.broadcast, loopback" in printed
