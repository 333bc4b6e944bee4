"""The TRL recipe (``docs/trainer.md``): ``GRPOTrainer`` training a tiny random-init Qwen2 on the CPU with
``SyncdPublishCallback`` publishing every K optimizer steps; every published version, materialized from the store,
is bit for bit the bf16 cast of the weights the callback saw at that step, and the weights changed between versions
(the reward has variance within a group, so GRPO's gradient is not zero)."""

from __future__ import annotations

import pytest
import torch

from syncd.engine.reference.make_tiny import write_model
from syncd.versions import list_versions, materialize
from syncd.trainer.trl_callback import SyncdPublishCallback

pytestmark = [pytest.mark.slow]

K, STEPS = 2, 5


class Recording(SyncdPublishCallback):
    """The callback, also keeping the bf16 cast of what it published per global step."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.seen: dict[int, dict] = {}

    def _publish(self, model, step):
        self.seen[step] = {k: v.detach().to(torch.bfloat16).clone() for k, v in model.state_dict().items()}
        super()._publish(model, step)


def test_grpo_trainer_publishes_every_k_steps_bit_for_bit(tmp_path):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    torch.use_deterministic_algorithms(True)
    model_dir = write_model(tmp_path / "model", arch="qwen2", seed=0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ds = Dataset.from_dict({"prompt": [f"count {i}: " for i in range(64)]})

    def ascii_share(completions, **kwargs):  # varies within a group on a random model: a non-zero gradient
        return [sum(ord(ch) < 128 for ch in c) / max(len(c), 1) for c in completions]

    store = tmp_path / "store"
    cb = Recording(str(store), "grpo-tiny", every_k=K, full_every=2, signing_key=False)
    cfg = GRPOConfig(output_dir=str(tmp_path / "run"), use_cpu=True, bf16=False, gradient_checkpointing=False,
                     per_device_train_batch_size=4, num_generations=4, max_completion_length=12, max_steps=STEPS,
                     learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no", seed=0, disable_tqdm=True)
    GRPOTrainer(model=model, reward_funcs=ascii_share, args=cfg, train_dataset=ds, processing_class=tok,
                callbacks=[cb]).train()

    # version 0 at the start, then steps K, 2K, ..., and the final step (5 is no multiple of 2)
    assert [s for _, s in cb.published] == [0, 2, 4, 5] and [v for v, _ in cb.published] == [0, 1, 2, 3]
    versions = [v for v in list_versions(str(store), "grpo-tiny", signing_key=False) if v.status == "ok"]
    assert [v.version for v in versions] == [0, 1, 2, 3]
    assert [v.manifest.kind for v in versions] == ["full", "delta", "full", "delta"]  # full_every=2
    prev = None
    for v in versions:
        got = materialize(str(store), "grpo-tiny", v.version, signing_key=False)
        want = cb.seen[v.manifest.step]
        assert got.keys() == want.keys()
        assert all(torch.equal(got[n], want[n]) for n in want), f"version {v.version} differs"
        if prev is not None:
            assert any(not torch.equal(got[n], prev[n]) for n in got), f"version {v.version} equals the last"
        prev = got
