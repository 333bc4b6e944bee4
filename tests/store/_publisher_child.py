"""A trainer process for the crash tests: publishes precomputed real-training snapshots, and kills itself
with SIGKILL at a chosen store write (``--kill-at N``: the N-th put, before or after it is done; with
``--kill-kind shard|manifest|hint``: the N-th put of that kind). Just before the kill it writes one line to
stderr, ``KILL <kind> <n> before|after <key>``, so that the test can check where the kill landed.

    python -m tests.store._publisher_child STORE RUN STATES START COUNT [--kill-at N [--kill-kind K] --kill-after]
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time

import torch

from syncd.store import Store
from syncd.publish.publisher import WeightPublisher


def kind_of(key: str) -> str:
    """``shard``, ``manifest``, ``hint`` or ``other``: what a put of ``key`` writes."""
    if key.endswith("/latest.json"):
        return "hint"
    if key.endswith("/manifest.json"):
        return "manifest"
    return "shard" if "/shards/" in key else "other"


class KillingStore(Store):
    def __init__(self, url, kill_at: int, after: bool, kind: str | None):
        super().__init__(url)
        self.kill_at, self.after, self.kind, self.puts = kill_at, after, kind, 0
        self.lock = threading.Lock()  # shards are put from several upload threads

    def put(self, key, data, *, create=False):
        with self.lock:
            if self.kind is None or kind_of(key) == self.kind:
                self.puts += 1
                n = self.puts
            else:
                n = 0
        if n == self.kill_at and not self.after:
            self._die(key, n, "before")
        out = super().put(key, data, create=create)
        if n == self.kill_at and self.after:
            self._die(key, n, "after")
        return out

    def _die(self, key: str, n: int, when: str) -> None:
        os.write(2, f"KILL {kind_of(key)} {n} {when} {key}\n".encode())
        os.kill(os.getpid(), signal.SIGKILL)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("store")
    p.add_argument("run")
    p.add_argument("states")
    p.add_argument("start", type=int)
    p.add_argument("count", type=int)
    p.add_argument("--kill-at", type=int, default=0)
    p.add_argument("--kill-after", action="store_true")
    p.add_argument("--kill-kind", choices=("shard", "manifest", "hint"), default=None)
    p.add_argument("--step-s", type=float, default=0.0, help="time each training step takes")
    a = p.parse_args()
    states = torch.load(a.states)
    store = KillingStore(a.store, a.kill_at, a.kill_after, a.kill_kind)
    with WeightPublisher(store, a.run, full_every=3, shard_bytes=16 << 10) as pub:
        for step in range(a.start, min(a.start + a.count, len(states))):
            time.sleep(a.step_s)  # the training step
            pub.publish(states[step], step)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
