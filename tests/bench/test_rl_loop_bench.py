"""bench.rl_loop runs end to end with tiny arguments: the asynchronous loop and the synchronous baseline, each on a
fresh stack (two engines under Dynamo, the proxy, the daemon), side by side, with JSON and a PNG."""

from __future__ import annotations

import json

import pytest

from bench import rl_loop

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_rl_loop_benchmark_tiny(tmp_path, capsys):
    out, png = tmp_path / "rl.json", tmp_path / "rl.png"
    assert rl_loop.main(["--modes", "async:1,sync", "--steps", "3", "--groups-per-step", "2", "--group-size", "4",
                         "--nproc", "1", "--json", str(out), "--plot", str(png)]) == 0
    printed = capsys.readouterr().out
    assert "generation ceiling tokens/s" in printed and "async-eta1 / sync trained tokens per second" in printed
    data = json.loads(out.read_text())
    a, s = data["runs"]["async-eta1"], data["runs"]["sync"]
    for r in (a, s):
        assert r["steps"] == 3 and len(r["reward_by_step"]) == 3 and len(r["reward_by_time"]) == 3
        assert r["tokens_trained"] == 3 * 2 * 4 * 8 and r["trained_tokens_per_s"] > 0
        assert sum(r["staleness_counts"].values()) == r["tokens_trained"]
        assert r["publish_to_serving_s_median"] is not None and r["rollout_failures"] == {
            k: 0 for k in r["rollout_failures"]}
        times = [t for t, _ in r["reward_by_time"]]
        assert times == sorted(times) and times[0] > 0
    assert set(s["staleness_counts"]) == {"0"} and set(a["staleness_counts"]) <= {"0", "1"}
    assert a["generation_ceiling_tokens_per_s"] > 0 and s["generation_ceiling_tokens_per_s"] is None
    assert a["over_sync_trained_tokens_per_s"] == pytest.approx(a["trained_tokens_per_s"] / s["trained_tokens_per_s"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert rl_loop.main(["--modes", "later"]) == 2
