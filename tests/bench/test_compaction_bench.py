"""bench.compaction runs end to end with tiny arguments (a model taught the repeat task, a real Dynamo frontend and
reference engine with a 64-token window, two sandbox proxies) and writes complete JSON and a PNG: the window cuts
every answer without compaction, compaction delivers every answer whole, and every training sample is
prefix-consistent."""

from __future__ import annotations

import json

import pytest

from bench import compaction

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_compaction_benchmark_tiny(tmp_path, capsys):
    out, png = tmp_path / "c.json", tmp_path / "c.png"
    assert compaction.main(["--window", "64", "--length", "150", "--requests", "2", "--hidden", "32",
                            "--train-steps", "30", "--summary-tokens", "6", "--json", str(out), "--plot", str(png)]) == 0
    printed = capsys.readouterr().out
    assert "without compaction" in printed and "prefix-consistent samples" in printed
    data = json.loads(out.read_text())
    a, b, s = data["with_compaction"], data["without_compaction"], data["prefix_consistent"]
    assert b["complete"] == 0.0 and b["tokens_mean"] == 64 - 2 and b["compactions_mean"] == 0  # cut by the window
    assert a["complete"] == 1.0 and a["tokens_mean"] == 150 and a["compactions_mean"] >= 2
    assert s["trajectories"] == 2 and not s["dropped"] and s["samples"] == 2 * (1 + a["compactions_mean"])
    assert s["fraction"] == 1.0 and 0 < s["summary_token_share"] < 1
    assert png.stat().st_size > 0
    assert compaction.main(["--window", "64", "--length", "64"]) == 2  # nothing to show: refused
