"""bench/broadcast.py runs end to end with tiny arguments (real node processes; shaped network namespaces
where this machine allows them) and writes its figures."""

from __future__ import annotations

import json

import pytest

from bench import broadcast
from bench import netsim as sim

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_broadcast_bench_tiny(tmp_path, capsys):
    out = tmp_path / "res.json"
    mode = "both" if sim.netns_available() is None else "unshaped"
    rc = broadcast.main(["--nodes", "2,3", "--size-mib", "1", "--repeats", "1", "--rate-mbit", "40",
                         "--chunk-kib", "64", "--mode", mode, "--json", str(out), "--plot", str(tmp_path / "b.png")])
    assert rc == 0
    res = json.loads(out.read_text())
    assert set(res["modes"]) == ({"shaped", "unshaped"} if mode == "both" else {"unshaped"})
    for r in res["modes"].values():
        assert r["S_bytes"] > 900_000 and r["single_tcp_s"] > 0
        assert [row["nodes"] for row in r["rows"]] == [2, 3]
        for row in r["rows"]:
            assert row["completion_s"] > 0 and row["ratio_single"] > 0
            assert row["store_over_S"] == pytest.approx(1.0), "each byte read from the store once"
    if mode == "both":
        assert res["modes"]["shaped"]["S_over_B_s"] == pytest.approx(res["modes"]["shaped"]["S_bytes"] * 8 / 40e6)
    printed = capsys.readouterr().out
    assert "single TCP transfer of S" in printed and "store bytes / S" in printed
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
