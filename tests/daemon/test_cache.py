"""syncd.cache: verified, atomic shard files; bounded by LRU eviction that never drops pinned shards;
manifests. (An engine update read from the cache: ``tests/engines/test_update.py``.)"""

from __future__ import annotations

import hashlib
import os
import time

import pytest

from syncd.cache import ShardCache, shard_path
from syncd.errors import IntegrityError
from tests.daemon.conftest import RUN


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def test_put_checks_the_hash_and_is_atomic(tmp_path):
    cache = ShardCache(tmp_path / "c")
    data = os.urandom(1000)
    with pytest.raises(IntegrityError):
        cache.put(sha(b"other"), data)
    assert not cache.has(sha(b"other")) and os.listdir(cache.tmp_dir) == []
    p = cache.put(sha(data), data)
    assert p == shard_path(cache.root, sha(data)) and cache.has(sha(data), 1000) and not cache.has(sha(data), 999)
    assert bytes(cache.read(sha(data))) == data
    # a file that rotted on disk is detected on read and removed
    p.write_bytes(bytes([data[0] ^ 1]) + data[1:])  # (b"x" + data[1:] left it intact when data[0] was b"x")
    with pytest.raises(IntegrityError, match="no longer matches"):
        cache.read(sha(data))
    assert not cache.has(sha(data))
    with pytest.raises(ValueError):
        cache.path("../../etc/passwd")


def test_eviction_is_lru_and_keeps_pinned_shards(tmp_path):
    cache = ShardCache(tmp_path / "c", max_bytes=2500)
    blobs = [os.urandom(1000) for _ in range(4)]
    for i, b in enumerate(blobs):
        cache.put(sha(b), b)
        t = time.time() - 100 + i
        os.utime(cache.path(sha(b)), (t, t))
    removed = cache.evict(pinned={sha(blobs[0])})
    # oldest unpinned go first until the cache fits 2500 bytes: blobs 1 and 2; blob 0 is pinned
    assert removed == [sha(blobs[1]), sha(blobs[2])]
    assert cache.has(sha(blobs[0])) and cache.has(sha(blobs[3])) and cache.shard_bytes() == 2000
    # pinned shards stay even above the bound
    cache.max_bytes = 500
    assert cache.evict(pinned={sha(blobs[0]), sha(blobs[3])}) == []
    assert cache.shard_bytes() == 2000


def test_clean_tmp_removes_leftovers_of_dead_writers_only(tmp_path):
    cache = ShardCache(tmp_path / "c")
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (cache.tmp_dir / f"{int(dead.stdout)}.abc.half-written").write_bytes(b"abc")  # its writer has exited
    (cache.tmp_dir / "no-pid").write_bytes(b"abc")
    fd, mine = cache.temp_file("x")  # a live writer's file (this process)
    os.close(fd)
    assert cache.clean_tmp() == 2 and os.listdir(cache.tmp_dir) == [os.path.basename(mine)]
    old = time.time() - 2 * 86400
    os.utime(mine, (old, old))
    assert cache.clean_tmp() == 1 and os.listdir(cache.tmp_dir) == []


def test_manifests_roundtrip(tmp_path):
    cache = ShardCache(tmp_path / "c")
    assert cache.get_manifest(RUN, 3) is None and cache.manifest_versions(RUN) == []
    cache.put_manifest(RUN, 3, b"{}")
    cache.put_manifest(RUN, 12, b"{1}")
    assert cache.get_manifest(RUN, 3) == b"{}" and cache.manifest_versions(RUN) == [3, 12]
    cache.drop_manifest(RUN, 3)
    assert cache.manifest_versions(RUN) == [12]
    with pytest.raises(ValueError):
        cache.put_manifest("../x", 1, b"{}")
