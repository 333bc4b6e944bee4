"""syncd.engines.update.Update: an update of a version in the node cache, read (every shard re-hashed) on first
use and once for every engine of the process that stages it; an in-process link's control state."""

from __future__ import annotations

import threading

import pytest

from syncd import engine
from syncd.cache import ShardCache
from syncd.engines.local import InProcessLink
from syncd.engines.update import Update
from syncd.errors import IntegrityError
from syncd.versions import cache_version, read_manifest
from tests.daemon.conftest import KEY, RUN, Published
from tests.engines._published import setup  # noqa: F401 (the fixture)
from tests.store._models import assert_same


def test_an_update_from_the_cache_full_and_delta(tmp_path):
    pub = Published(tmp_path / "store")
    try:
        pub.publish(2)
        cache = ShardCache(tmp_path / "c")
        raws = {v: cache_version(pub.store, RUN, v, cache, signing_key=KEY) for v in (0, 1)}
        full = Update.from_cache(raws[0], cache.root).load()
        assert full.kind == "full" and full.version == 0
        assert_same(dict(full.tensors), pub.states[0])
        d = Update.from_cache(raws[1], cache.root, verify_shards=True).load()
        assert d.kind == "delta" and d.base_version == 0 and set(d.tensors) == set(pub.states[1])
        from syncd.ops import delta

        got = {k: delta.decode(pub.states[0][k], d.tensors[k]) for k in pub.states[1]}
        assert_same(got, pub.states[1])
        assert d.checksums == {t.name: t.checksum for t in read_manifest(pub.store, RUN, 1, signing_key=KEY).tensors}
        # a shard missing from the cache, and one altered in it
        s0 = read_manifest(pub.store, RUN, 1, signing_key=KEY).shards[0]
        data = bytes(cache.read(s0.sha256))
        cache.discard(s0.sha256)
        with pytest.raises(FileNotFoundError, match="not in the cache"):
            Update.from_cache(raws[1], cache.root).load()
        cache.path(s0.sha256).write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
        with pytest.raises(IntegrityError):
            Update.from_cache(raws[1], cache.root, verify_shards=True).load()
    finally:
        pub.close()


def test_engines_of_one_process_share_one_read_of_a_cached_update(setup, monkeypatch):
    import syncd.cache

    pub, cache, raws = setup
    reads = []
    real = syncd.cache.read_shards
    monkeypatch.setattr(syncd.cache, "read_shards", lambda *a, **kw: reads.append(1) or real(*a, **kw))
    update = Update.from_cache(raws[1], cache.root)
    assert (update.version, update.kind, update.base_version, update.source.raw) == (1, "delta", 0, raws[1])
    assert not reads  # nothing is read before an engine reads the tensors
    engines = [engine.StateDictEngine({k: v.clone() for k, v in pub.states[0].items()}, 0) for _ in range(3)]
    threads = [threading.Thread(target=e.stage, args=(update,)) for e in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(reads) == 1
    for e in engines:
        e.pause()
        e.apply()
        assert_same(e.state_dict(), pub.states[1])


def test_an_update_needs_tensors_or_a_source():
    with pytest.raises(ValueError, match="tensors or a source"):
        Update(1, "delta")


def test_an_in_process_link_counts_the_writes_made_through_it(setup):
    pub, cache, raws = setup
    link = InProcessLink(engine.StateDictEngine(pub.zeros(), None))
    first = link.state()
    assert (first["run_id"], first["version"], first["writes"], first["lease"]) == (None, None, 0, None)
    assert link.lease() == first and link.release() is None and link.last_writes is None
    link.pause()
    link.load_full(Update.from_cache(raws[0], cache.root))
    link.stage(Update.from_cache(raws[1], cache.root))
    link.apply()
    link.rollback()
    with pytest.raises(RuntimeError):
        link.rollback()  # nothing to undo: the weights are unchanged, and so is the counter
    state = link.state()
    assert (state["version"], state["writes"], state["instance"], link.last_writes) == (0, 3, first["instance"], 3)
    assert link.checksum() == link.adapter.checksum() and link.url == "in-process"
