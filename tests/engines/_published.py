"""A store with versions 0 (full), 1, 2 (deltas) and a node cache holding their shards, for the tests of the
engine contract (here) and of its engine-side half (``tests/engines/test_control.py``)."""

from __future__ import annotations

import pytest

from syncd.cache import ShardCache
from syncd.versions import cache_version
from tests.daemon.conftest import KEY, RUN, Published


@pytest.fixture
def setup(tmp_path):
    """Versions 0 (full), 1, 2 (deltas) in a store; their shards and manifests in a node cache."""
    pub = Published(tmp_path / "store")
    pub.publish(3)
    cache = ShardCache(tmp_path / "cache")
    raws = {v: cache_version(pub.store, RUN, v, cache, signing_key=KEY) for v in range(3)}
    yield pub, cache, raws
    pub.close()
