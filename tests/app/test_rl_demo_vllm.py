"""``syncd demo --engine vllm`` end to end with a few steps: one real vLLM engine (CPU) under Dynamo recording replay
records, the proxy, the daemon and the thin trainer (two ranks). It exits 0: no rollout lost, every record joined,
the engine on the trainer's last version with the checksum of every one of vLLM's own parameters equal to what the
version gives it (the fused ``qkv_proj``/``gate_up_proj`` against the same fusion of the materialized version; the
demo says what it compared).

The records are replayed: every trained token's record has a kept set holding the sampled token, and at step 1
(every token sampled by version 0, the weights the trainer has) the trainer's log-probs, taken on the recorded kept
sets, equal vLLM's processed log-probs to float rounding -- the full-vocabulary log-probs would differ by the
log of the kept mass (top-p 0.95). The IS correction runs on them (its weights in every step's metrics). With
``--moe`` (Qwen3-MoE, 8 experts, top-2) every record carries its tokens' routes, the trainer replays them and at
step 1 its routing disagrees with vLLM's on no token."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_syncd_demo_on_vllm_replays_its_records(tmp_path, moe):
    if os.environ.get("SYNCD_VLLM") == "off":
        pytest.skip("SYNCD_VLLM=off: the vllm extra is not installed on this machine")
    out, work = tmp_path / "demo.json", tmp_path / "work"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    p = subprocess.run([sys.executable, "-m", "syncd.app.cli", "demo", "--engine", "vllm", "--steps", str(STEPS),
                        "--json", str(out), "--plot", "", "--dir", str(work), *(["--moe"] if moe else [])],
                       cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    s = json.loads(out.read_text())
    assert s["engine"] == "vllm" and s["engines"] == 1 and s["engines_bit_exact"] is True
    assert s["rollouts_lost"] == 0 and s["final_version"] == STEPS and s["versions_applied"] >= 1
    assert s["steps"] == STEPS and s["ranks_agree"] is True
    [checked] = s["engine_weights_checked"].values()
    assert "fused" in checked and f"worker0: checksums compared for {checked}" in p.stdout
    n, total = checked.split(" of its ")[0], checked.split(" of its ")[1].split(" ")[0]
    assert n == total and int(n) > 0  # every vLLM parameter compared
    from syncd.trainer.rl.metrics import read_metrics

    steps = [ln for ln in read_metrics(work / "trainer" / "metrics.jsonl") if ln["kind"] == "step"]
    assert len(steps) == STEPS and all(ln["is_weight_mean"] is not None for ln in steps)
    first = steps[0]
    assert first["staleness_max"] == 0 and first["max_abs_log_ratio"] < 1e-4 and first["is_outside"] == 0, first
    assert all(not ln["refused_groups"] and not ln["rollout_failures"] for ln in steps)
    if moe:  # the recorded routes replayed: at step 1 the trainer's router picks what vLLM's picked
        assert first["routing_disagreement"] == 0 and all("routing_disagreement" in ln for ln in steps), first
    # every record the demo's store holds joins its trajectory, with a kept set holding each sampled token
    from syncd.trainer.rl.rollouts import read_rollouts

    rs = read_rollouts(str(work / "store"), "rl", num_experts=8 if moe else None)
    assert not rs.dropped and len(rs.rollouts) == s["rollout_requests"]
    kept_sizes = []
    for seq in (q for r in rs.rollouts for q in r.sequences):
        assert (seq.routes is not None and tuple(seq.routes.shape[1:]) == (2, 2)) if moe else seq.routes is None
        pending = set() if seq.kept_pending is None else set(seq.kept_pending.rows.tolist())  # rebuilt by the trainer
        targets = seq.tokens[seq.positions]
        for g in sorted(set(range(int(seq.loss_mask.sum()))) - pending):
            kept = seq.kept_ids[seq.kept_offsets[g]:seq.kept_offsets[g + 1]].tolist()
            assert int(targets[g]) in kept
            kept_sizes.append(len(kept))
    assert kept_sizes and max(kept_sizes) > 1
