"""Helpers of the hardening tests (issue 14): a run of the engines' own model published from the test
process (real AdamW steps), and the hostile objects an attacker with write access to the store, or a
careless operator, can leave there."""

from __future__ import annotations

import functools
import json
import os
import time
from pathlib import Path

from syncd import manifest as mf
from syncd.ops import checksum
from syncd.store import Store
from tests.daemon.conftest import KEY, RUN
from syncd.publish.publisher import WeightPublisher


@functools.lru_cache(maxsize=4)
def model_states(model_dir: str, n: int = 12) -> tuple:
    """The bf16 weights after 0..n-1 real AdamW steps from the model folder's weights (cached)."""
    from tests.daemon._trainer_child import load_model
    from tests.store._models import bf16, train_steps

    model = load_model(model_dir)
    out = [bf16(model.state_dict())]
    train_steps(model, n - 1, lr=1e-4, callback=lambda _s, m: out.append(bf16(m.state_dict())))
    return tuple(out)


class ModelRun:
    """Versions of the engines' model in a file store: ``publish()`` the next real step; ``checksums(v)``
    what an engine at version v must hold."""

    def __init__(self, store_root: Path, model_dir: Path, *, run_id: str = RUN, key=KEY, full_every: int = 3,
                 n: int = 12):
        self.root = Path(store_root)
        self.store = Store(self.root)
        self.states = model_states(str(model_dir), n)
        self.pub = WeightPublisher(self.store, run_id, signing_key=key, full_every=full_every, shard_bytes=16 << 10)
        self.run_id = run_id
        self.published: list[int] = []

    def publish(self, n: int = 1) -> int:
        for _ in range(n):
            step = len(self.published)
            self.pub.publish(self.states[step], step)
            self.pub.flush()
            self.published.append(self.pub.last_version)
        return self.pub.last_version

    def checksums(self, version: int) -> dict[str, int]:
        return {k: checksum(v) for k, v in self.states[self.published.index(version)].items()}

    def manifest_path(self, version: int) -> Path:
        return self.root / mf.manifest_key(self.run_id, version)

    def hint_path(self) -> Path:
        return self.root / mf.latest_hint_key(self.run_id)

    def close(self) -> None:
        self.pub.close()


def write_atomic(path: Path, data: bytes) -> None:
    """What an attacker with write access does: put an object (atomically, as every store does)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


NESTED_HINT = b"[" * 4096  # the forged latest.json of issue 14, case 1
FAR_FUTURE = 999999999998


def hint(version) -> bytes:
    return json.dumps({"run_id": RUN, "version": version, "step": 0, "created_at": "2026-01-01T00:00:00Z"}).encode()
