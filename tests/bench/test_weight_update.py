"""bench/weight_update.py runs end to end with tiny arguments and writes its figures."""

from __future__ import annotations

import json

from bench import weight_update


def test_weight_update_bench_tiny(tmp_path, capsys):
    out = tmp_path / "res.json"
    rc = weight_update.main(["--model", "tiny", "--versions", "4", "--full-every", "3", "--lr", "1e-5",
                             "--store", str(tmp_path / "store"), "--out", str(out), "--signing-key",
                             "bench-key-0123456789abcdef"])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["latest_bit_exact"] is True
    rows = res["versions"]
    assert [r["kind"] for r in rows] == ["full", "delta", "delta", "full"]
    for r in rows:
        assert r["bytes"] > 0 and r["base_bytes"] > 0
    assert all(r["ratio"] < 0.5 for r in rows if r["kind"] == "delta")  # deltas beat full uploads
    printed = capsys.readouterr().out
    assert "as full safetensors" in printed and "publish() median" in printed
    assert not list((tmp_path / "store").rglob("baseline/*"))  # the baseline objects are cleaned up
