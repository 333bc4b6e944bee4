"""A real trainer for engine tests: a tiny model's AdamW steps published by ``syncd.trainer.WeightPublisher`` into a
file store (version 0 full, then deltas), with each version's bf16 state kept to compare engines against."""

from __future__ import annotations

import torch

KEY = "vllm-test-signing-key-0123456789ab"
RUN = "vllm"


class Trainer:
    """A real trainer: the model in float32, AdamW steps on random tokens (``tests.store._models.train_steps``),
    every state published by ``syncd.trainer.WeightPublisher`` (version 0 full, then deltas) into a file store;
    ``snaps[v]`` is version v's bf16 state dict. ``publisher``: more WeightPublisher arguments (the delta
    format)."""

    def __init__(self, model_dir, store, *, run=RUN, key=KEY, lr=3e-4, publisher=None):
        from transformers import AutoModelForCausalLM

        from syncd.trainer import WeightPublisher

        self.store, self.run, self.key, self.lr = store, run, key, lr
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.pub = WeightPublisher(store, run, signing_key=key, full_every=1000, **(publisher or {}))
        self.snaps: list[dict] = []
        self._publish()

    def _publish(self):
        assert self.pub.publish(self.model, len(self.snaps))
        self.pub.flush()
        self.snaps.append({k: v.detach().to(torch.bfloat16).clone() for k, v in self.model.state_dict().items()})
        assert self.pub.last_version == len(self.snaps) - 1

    def step(self) -> int:
        """One optimizer step, published; returns the new version."""
        from tests.store._models import train_steps

        train_steps(self.model, 1, lr=self.lr, seed=len(self.snaps))
        self._publish()
        return len(self.snaps) - 1

    def update(self, version: int):
        """The verified Update of ``version`` from the store (what the daemon would hand an engine)."""
        from syncd.engines.update import Update
        from syncd.versions import fetch_shards, read_manifest

        m = read_manifest(self.store, self.run, version, signing_key=self.key)
        return Update.from_shards(m, fetch_shards(self.store, self.run, m))

    def hf_model(self, version: int):
        """A transformers model holding version ``version``'s weights (float32 of the bf16 words)."""
        from transformers import AutoModelForCausalLM

        m = AutoModelForCausalLM.from_config(self.model.config, dtype=torch.float32).eval()
        m.load_state_dict({k: v.float() for k, v in self.snaps[version].items()})
        return m

    def close(self):
        self.pub.close()
