"""bench/weight_update.py runs end to end with tiny arguments and writes its figures."""

from __future__ import annotations

import json

from bench import weight_update


def test_weight_update_bench_tiny(tmp_path, capsys):
    out = tmp_path / "res.json"
    rc = weight_update.main(["--model", "tiny", "--versions", "4", "--full-every", "3", "--lr", "1e-5",
                             "--store", str(tmp_path / "store"), "--json", str(out), "--signing-key",
                             "bench-key-0123456789abcdef", "--poll-interval-s", "0.1", "--delta-format", "2"])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["latest_bit_exact"] is True and res["delta_format"] == 2
    rows = res["versions"]
    assert [r["kind"] for r in rows] == ["full", "delta", "delta", "full"]
    for r in rows:
        assert r["bytes"] > 0 and r["base_bytes"] > 0
    assert all(r["ratio"] < 0.5 for r in rows if r["kind"] == "delta")  # deltas beat full uploads
    # the end-to-end case: a node daemon kept two engines current, deltas and full safetensors side by side
    e2e = res["e2e"]
    assert e2e["engines"] == 2 and e2e["delta"]["engines_bit_exact"] and e2e["full"]["engines_bit_exact"]
    assert [r["kind"] for r in e2e["delta"]["versions"]] == ["delta", "delta", "full"]
    assert [r["kind"] for r in e2e["full"]["versions"]] == ["full", "full", "full"]
    for r in e2e["delta"]["versions"] + e2e["full"]["versions"]:
        parts = [r[p] for p in ("encode", "upload", "poll", "download", "decode", "pause")]
        assert all(x >= 0 for x in parts) and 0 < r["pause"] <= r["pause_sum"] < r["e2e"]
        assert sum(parts) <= r["e2e"] + 1e-6
    printed = capsys.readouterr().out
    assert "as full safetensors" in printed and "publish() median" in printed
    assert "median e2e lag" in printed
    assert not list((tmp_path / "store").rglob("baseline/*"))  # the baseline objects are cleaned up
