"""A store with versions 0 (full), 1, 2 (deltas) and a node cache holding their shards, for the tests of the
engine contract (here) and of its engine-side half (``tests/engines/test_control.py``)."""

from __future__ import annotations

import pytest

from syncd.cache import ShardCache
from syncd.versions import fetch_shards, read_manifest
from tests.daemon.conftest import KEY, RUN, Published


@pytest.fixture
def setup(tmp_path):
    """Versions 0 (full), 1, 2 (deltas) in a store; their shards and manifests in a node cache."""
    pub = Published(tmp_path / "store")
    pub.publish(3)
    cache = ShardCache(tmp_path / "cache")
    raws = {}
    for v in range(3):
        m = read_manifest(pub.store, RUN, v, signing_key=KEY)
        for s, data in zip(m.shards, fetch_shards(pub.store, RUN, m)):
            cache.put(s.sha256, data)
        raws[v] = pub.store.get(f"runs/{RUN}/versions/{v:012d}/manifest.json")
    yield pub, cache, raws
    pub.close()
