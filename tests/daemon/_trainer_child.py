"""A trainer process for the daemon tests: real AdamW steps on a tiny random-init Qwen2, one version
published per step with ``syncd.trainer.WeightPublisher``; records what it published.

    python -m tests.daemon._trainer_child STORE RUN --model DIR --steps N [--gate-dir D] [--record F]
        [--full-every M] [--shard-bytes B] [--seed S] [--tamper corrupt@V|badsig@V ...]

``--model``: a model folder (``syncd.engine.reference.make_tiny``); training starts from its weights, so the
trainer's tensor names are the engine's.

``--gate-dir``: before step ``s`` the child waits for the file ``D/s`` (the test releases versions one at a
time). ``--record``: one JSON line per committed version ``{"version", "step", "checksums": {name: hex}}``
(the trainer's own checksums of the bf16 weights it published). ``--tamper``: fault injection for the
rejection tests -- ``corrupt@V`` flips a byte of version V's first shard as it is uploaded (its manifest
keeps the true hash), ``badsig@V`` signs version V's manifest with another key.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from syncd import manifest as mf
from syncd.ops import checksum
from syncd.signing import SigningKey
from syncd.store import Store
from tests.store._models import bf16, train_steps
from syncd.publish.publisher import WeightPublisher


class TamperingStore(Store):
    """A file store that damages chosen versions on their way in (see the module docstring)."""

    def __init__(self, url, tamper: dict[int, str]):
        super().__init__(url)
        self.tamper = tamper
        self.corrupted: set[int] = set()

    def put(self, key, data, *, create=False):
        if "/versions/" in key:
            v = mf.parse_version_dir(key.split("/versions/")[1].split("/")[0])
            how = self.tamper.get(v)
            if how == "corrupt" and "/shards/" in key and v not in self.corrupted:
                self.corrupted.add(v)
                data = bytearray(data)
                data[len(data) // 2] ^= 0x01
            elif how == "badsig" and key.endswith("manifest.json"):
                m = mf.parse(bytes(data), key=None, allow_unsigned=True)
                data = m.encode(SigningKey(b"not-the-run-signing-key-0123456789"))
        return super().put(key, data, create=create)


def load_model(folder: str):
    """The float32 trainable model of a model folder (config + bf16 safetensors)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from syncd.engine.reference.model import load_folder_weights

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32)
    model.load_state_dict({k: v.float() for k, v in load_folder_weights(folder).items()})
    return model


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("store")
    p.add_argument("run")
    p.add_argument("--model", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--gate-dir", default=None)
    p.add_argument("--record", default=None)
    p.add_argument("--full-every", type=int, default=3)
    p.add_argument("--shard-bytes", type=int, default=16 << 10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--tamper", action="append", default=[])
    a = p.parse_args(argv)
    tamper = {}
    for t in a.tamper:
        how, _, v = t.partition("@")
        tamper[int(v)] = how
    store = TamperingStore(a.store, tamper)
    model = load_model(a.model)
    pub = WeightPublisher(store, a.run, full_every=a.full_every, shard_bytes=a.shard_bytes)
    record = open(a.record, "a") if a.record else None

    def gate(step: int) -> None:
        if a.gate_dir is None:
            return
        deadline = time.monotonic() + 300
        while not os.path.exists(os.path.join(a.gate_dir, str(step))):
            if time.monotonic() > deadline:
                sys.exit(f"trainer: gate {step} never opened")
            time.sleep(0.02)

    def publish(step: int, m) -> None:
        gate(step)
        weights = bf16(m.state_dict())
        pub.publish(weights, step)
        pub.flush()
        if record is not None:
            record.write(json.dumps({"version": pub.last_version, "step": step,
                                     "checksums": {k: f"{checksum(v):016x}" for k, v in weights.items()}}) + "\n")
            record.flush()

    publish(0, model)
    if a.steps > 1:
        train_steps(model, a.steps - 1, lr=a.lr, seed=a.seed, callback=lambda s, m: publish(s + 1, m))
    pub.close()
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
