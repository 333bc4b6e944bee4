"""``syncd demo`` (the README's first command) end to end with fewer steps: the thin trainer with two ranks, two
engines under Dynamo, the proxy and the daemon; it exits 0 with nothing lost and the engines bit-exact on the
trainer's last version, and its summary has the reward before and after, versions, pauses, staleness and the
mismatch diagnostics.

The RL loop must learn: the mean reward of the last :data:`WINDOW` steps exceeds the first ones' by more than
:data:`RISE_SE` standard errors of that difference, each window's spread measured step to step from the trainer's
own metrics (a rise step-to-step noise would give fails), and by more than :data:`MIN_RISE` at least. The kept store
reads with the key the demo prints (tests/app/test_demo.py: ``assert_kept_store_reads``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.app.conftest import delta_formats_in

ROOT = Path(__file__).resolve().parents[2]
STEPS = 20
RISE_SE = 3.0  # standard errors of the difference of the two window means
MIN_RISE = 0.1  # of the reward's 0..1 range, whatever the noise
WINDOW = STEPS // 4  # steps per window: five points give each window's spread


def rise_and_its_standard_error(rewards: list[float], window: int) -> tuple[float, float]:
    """(last window's mean - first window's mean, the standard error of that difference from each window's
    step-to-step variance)."""
    import statistics

    first, last = rewards[:window], rewards[-window:]
    se = (statistics.variance(first) / window + statistics.variance(last) / window) ** 0.5
    return statistics.fmean(last) - statistics.fmean(first), se


@pytest.mark.integration
@pytest.mark.slow
def test_syncd_demo_runs_the_rl_loop(tmp_path):
    out, png = tmp_path / "demo.json", tmp_path / "demo.png"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    p = subprocess.run([sys.executable, "-m", "syncd.app.cli", "demo", "--steps", str(STEPS), "--json", str(out),
                        "--plot", str(png), "--dir", str(tmp_path / "work")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    s = json.loads(out.read_text())
    assert s["rollouts_lost"] == 0 and s["engines_bit_exact"] is True and s["engines"] == 2
    assert s["final_version"] == STEPS and s["versions_published"] == STEPS + 1 and s["versions_applied"] >= 1
    assert s["steps"] == STEPS and s["ranks_agree"] is True
    from syncd.trainer.rl.metrics import read_metrics

    rewards = [ln["reward_mean"] for ln in read_metrics(tmp_path / "work" / "trainer" / "metrics.jsonl")
               if ln["kind"] == "step"]
    rise, se = rise_and_its_standard_error(rewards, WINDOW)
    assert len(rewards) == STEPS and s["reward_after"] > s["reward_before"]  # the summary's shorter windows too
    assert rise > max(RISE_SE * se, MIN_RISE), (rise, se, [round(r, 3) for r in rewards])
    assert s["pause_s_median"] is not None and s["pause_s_max"] >= s["pause_s_median"] > 0
    assert s["staleness_max"] <= 2 and sum(s["staleness_counts"].values()) == s["tokens_trained"] == STEPS * 4 * 8 * 8
    assert 0 < s["is_mean_median"] < 10 and s["kl_k3_median"] >= 0 and s["is_outside_median"] is not None
    assert "syncd demo summary (RL)" in p.stdout and "[demo] step" in p.stdout  # plain lines off a terminal
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and s["timeline_png"] == str(png.resolve())
    assert Path(s["trainer_png"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the trainer's picture, next to it
    # the first line comes before anything slow starts, and says where the work goes; the delta's size is printed
    assert p.stdout.splitlines()[0].startswith("[demo] an RL run on this machine") and str(tmp_path / "work") in \
        p.stdout.splitlines()[0]
    assert s["deltas"] >= 1 and 0 < s["delta_fraction_median"] < 1 and s["delta_bytes_median"] < s["full_bytes"]
    assert f"{s['delta_fraction_median']:.1%} of the" in p.stdout and s["workdir"] in p.stdout
    # the demo publishes format 2 (its engines hold every tensor whole): the matrices' deltas are context-coded
    formats = delta_formats_in(tmp_path / "work" / "store")
    assert s["delta_format"] == 2 and "format 2)" in p.stdout and formats.get(-2, 0) > 0 and 1 not in formats, formats
    from tests.app.test_demo import assert_kept_store_reads

    assert_kept_store_reads(p.stdout, tmp_path / "work", env, versions=STEPS + 1)
