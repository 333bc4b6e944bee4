"""Fixtures of the cluster tests: real versions from real AdamW steps, published by syncd.trainer.WeightPublisher
to a real file store; node processes on loopback."""

from __future__ import annotations

import pytest

from bench.netsim import NodeProcs, free_port
from bench.netsim.etcd import EtcdServer
from tests.cluster._util import KEY, RUN, SECRET
from tests.daemon._fixtures import model_dir, procs  # noqa: F401  (fixtures shared by both packages)
from tests.store._models import trajectory
from syncd.trainer import WeightPublisher


@pytest.fixture(scope="session")
def states():
    """bf16 weights after each of 11 real AdamW steps of a tiny Qwen2 (about 214 KB each)."""
    return trajectory(12)


class Publisher:
    """Publishes ``states[i]`` as step ``i`` (full every 3 versions; 16 KiB shards: ~14 shards each)."""

    def __init__(self, store, states, **kw):
        self.states = states
        self.pub = WeightPublisher(store, RUN, signing_key=KEY, full_every=kw.pop("full_every", 3),
                                   shard_bytes=kw.pop("shard_bytes", 16 << 10), **kw)
        self.step = 0

    def next(self) -> int:
        """Publish the next state and wait until its version is committed; returns the version."""
        self.pub.publish(self.states[self.step], self.step)
        self.pub.flush()
        self.step += 1
        return self.pub.history[-1].version

    def close(self):
        self.pub.close()


@pytest.fixture
def make_cluster(tmp_path):
    """``make_cluster(n, store, *flags)`` -> :class:`NodeProcs` of ``n`` nodes on loopback (not started);
    every process is stopped at teardown, and its log printed if the test failed."""
    made = []

    def make(n, store, *args, **kw):
        addrs = {r: ("127.0.0.1", free_port()) for r in range(n)}
        c = NodeProcs(tmp_path / f"cluster{len(made)}", store=str(store), run_id=RUN, secret=SECRET,
                      signing_key=KEY, addrs=addrs,
                      args=["--heartbeat-s", "0.25", "--poll-s", "0.2", "--no-fsync", "--chunk-bytes", "8192",
                            "--stall-s", "1.5", *args], **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.stop_all()


@pytest.fixture
def etcd(tmp_path):
    """A real etcd (Debian's etcd-server, ``scripts/setup_services.sh``) on loopback ports, its data under
    ``tmp_path`` (so a test can kill and restart it); stopped at teardown."""
    server = EtcdServer(tmp_path / "etcd").start()
    yield server
    server.stop()
