"""bench.serve runs end to end on a tiny node (real frontend, workers and proxy) and writes complete JSON."""

from __future__ import annotations

import json

import pytest

from bench import serve

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_serve_benchmark_tiny(tmp_path, capsys):
    out = tmp_path / "serve.json"
    assert serve.main(["--preset", "tiny", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "x direct" in printed and "migration:" in printed
    data = json.loads(out.read_text())
    res, cfg = data["results"], data["config"]
    for path in ("direct", "frontend", "proxy"):
        r = res[path]
        assert r["requests_per_s"] > 0 and r["tokens_per_s"] == pytest.approx(r["requests_per_s"] * cfg["tokens"])
        assert 0 < r["latency_median_s"] <= r["latency_max_s"]
    m = res["migration"]
    assert len(m["pairs"]) == cfg["migrations"] and m["undisturbed_median_s"] > 0
    assert all(p["migrated_s"] > 0 for p in m["pairs"])
