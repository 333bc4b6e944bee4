"""syncd.daemon.planner over a real store: delta chain vs newer full version by bytes, routing around
rejected versions, never backwards."""

from __future__ import annotations

import pytest

from syncd.cache import ShardCache
from syncd.manifest_source import ManifestSource
from syncd.daemon.metrics import DaemonMetrics
from syncd.daemon.planner import plan_update, walk_back
from syncd.errors import IntegrityError, ManifestMismatch, SignatureError
from syncd.signing import parse_key
from tests.daemon.conftest import KEY, RUN, Published


@pytest.fixture
def source(tmp_path):
    pub = Published(tmp_path / "store", full_every=4)
    pub.publish(9)  # 0F 1 2 3 4F 5 6 7 8F
    src = ManifestSource(RUN, store=pub.store, cache=ShardCache(tmp_path / "c"), key=parse_key(KEY),
                         metrics=DaemonMetrics())
    yield pub, src
    pub.close()


def test_walk_back_reaches_the_newest_full_version(source):
    _, src = source
    assert [m.version for m in walk_back(src, 7)] == [4, 5, 6, 7]
    assert [m.version for m in walk_back(src, 4)] == [4]


def test_chain_when_it_is_smaller_full_when_the_chain_is_longer(source):
    _, src = source
    p = plan_update(src, 5, 7)
    assert (p.versions, p.from_full) == ([6, 7], False)
    # from 3 the chain cannot reach 7 (4 is a full version): full 4 + deltas
    p = plan_update(src, 3, 7)
    assert (p.versions, p.from_full) == ([4, 5, 6, 7], True)
    # unknown weights: rebuild from the newest full version
    p = plan_update(src, None, 8)
    assert (p.versions, p.from_full) == ([8], True)
    assert plan_update(src, 8, 8) is None and plan_update(src, 8, 7) is None  # nothing to do, never backwards


def test_skips_ahead_over_older_chains_to_the_newest_full_version(source):
    _, src = source
    # from 1 with fulls at 4 and 8: one full version (8) moves far fewer bytes than 2,3,4F,5,6,7,8F
    p = plan_update(src, 1, 8)
    assert (p.versions, p.from_full) == ([8], True)
    assert p.bytes == src.get(8).total_bytes < sum(src.get(v).total_bytes for v in range(2, 9))


def test_routes_around_rejected_versions(source):
    pub, src = source
    src.reject(6, IntegrityError("shard altered"))
    # 7 needs 6: the newest reachable version above 5 is... none below 7 except 6 (rejected) -> nothing
    assert plan_update(src, 5, 7) is None
    # from 3, 7 and 6 are out of reach, 5 is reachable via full 4
    p = plan_update(src, 3, 7)
    assert p.versions == [4, 5] and p.target == 5
    # from 5, 8 is a full version: the way around
    assert plan_update(src, 5, 8).versions == [8]
    assert src.metrics.totals["rejected:integrity"] == 1


def test_a_forged_manifest_is_rejected_and_counted(source, tmp_path):
    pub, src = source
    key = f"runs/{RUN}/versions/{8:012d}/manifest.json"
    raw = pub.store.get(key)
    from syncd import manifest as mf
    from syncd.signing import SigningKey

    forged = mf.parse(raw, key=None, allow_unsigned=True).encode(SigningKey(b"another-key-0123456789abcdef"))
    pub.store.put(key, forged)
    with pytest.raises(SignatureError):
        src.get(8)
    assert src.rejected(8).startswith("signature")
    with pytest.raises(ManifestMismatch, match="rejected"):
        src.get(8)  # remembered: not read again for retry_failed_s
    assert src.metrics.totals["rejected:signature"] == 1
    p = plan_update(src, 5, 8)
    assert p.target == 7 and p.versions == [6, 7]
