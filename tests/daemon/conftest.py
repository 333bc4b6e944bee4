"""Shared pieces of the daemon tests: a real file store with versions published by
``syncd.trainer.WeightPublisher`` from real AdamW steps (``tests/store/_models.trajectory``)."""

from __future__ import annotations


import pytest
import torch

from syncd.store import Store
from tests.daemon._fixtures import model_dir, procs  # noqa: F401  (fixtures shared by both packages)
from tests.store._models import trajectory
from syncd.publish.publisher import WeightPublisher

from syncd.procs import free_port  # noqa: F401 -- the tests import it from here

KEY = "daemon-test-key-0123456789abcdef"
RUN = "r"


class Published:
    """A store, a publisher (``full_every`` 3, small shards; ``publisher``: more WeightPublisher arguments) and
    the trainer's states, published on demand."""

    def __init__(self, root, *, full_every: int = 3, n_states: int = 12, **publisher):
        self.store = Store(root)
        self.states = trajectory(n_states)
        self.pub = WeightPublisher(self.store, RUN, signing_key=KEY, full_every=full_every, shard_bytes=16 << 10,
                                   **publisher)
        self.step = 0

    def publish(self, n: int = 1) -> int:
        """Publish the next ``n`` states; returns the newest version."""
        for _ in range(n):
            self.pub.publish(self.states[self.step], self.step)
            self.step += 1
        self.pub.flush()
        return self.pub.last_version

    def zeros(self) -> dict:
        return {k: torch.zeros_like(v) for k, v in self.states[0].items()}

    def close(self):
        self.pub.close()


@pytest.fixture
def published(tmp_path):
    p = Published(tmp_path / "store")
    yield p
    p.close()


@pytest.fixture
def run(tmp_path, model_dir):
    """The engines' own model published from the test process (``tests.daemon._hostile.ModelRun``)."""
    from tests.daemon._hostile import ModelRun  # here: _hostile imports this module

    r = ModelRun(tmp_path / "store", model_dir)
    yield r
    r.close()
