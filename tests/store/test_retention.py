"""Retention: what is kept (every retained version stays materializable), grace periods, orphans, and
retention running while readers materialize."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest

import syncd
from syncd import manifest as mf
from syncd.errors import VersionNotFound
from syncd.store import Store
from syncd.retention import RetentionPolicy, apply_retention, plan_retention
from syncd.versions import list_versions, read_manifest
from syncd.publish.publisher import WeightPublisher

from ._models import assert_same, trajectory
from .conftest import KEY
from .test_versions import publish_all

RUN = "run-a"


@pytest.fixture
def eight(tmp_path):
    """Versions 0F 1d 2d 3F 4d 5d 6F 7d in a local store."""
    store = Store(tmp_path / "s")
    return store, publish_all(store, states=trajectory(8))


def versions_in(store):
    return [i.version for i in list_versions(store, RUN, signing_key=KEY)]


@pytest.mark.parametrize("keep_last,kept", [(1, [6, 7]), (2, [6, 7]), (3, [3, 4, 5, 6, 7]), (5, [3, 4, 5, 6, 7]),
                                            (6, list(range(8))), (100, list(range(8)))])
def test_retained_versions_and_their_chains_survive(eight, keep_last, kept):
    store, states = eight
    plan = apply_retention(store, RUN, RetentionPolicy(keep_last=keep_last, grace_s=0), signing_key=KEY)
    assert plan.keep == kept and versions_in(store) == kept
    for v in range(8):
        if v in kept:
            assert_same(syncd.materialize(store, RUN, v, signing_key=KEY), states[v])
        else:
            with pytest.raises(VersionNotFound):
                syncd.materialize(store, RUN, v, signing_key=KEY)
    assert not any(o.key.startswith(mf.versions_prefix(RUN) + f"{v:012d}/") for v in range(8) if v not in kept
                   for o in store.list(mf.versions_prefix(RUN)))


def test_never_deletes_the_base_of_a_retained_delta(eight):
    store, states = eight
    # keep only 4 and 5 -- deltas whose chain starts at full version 3
    apply_retention(store, RUN, RetentionPolicy(keep_last=4, grace_s=0), signing_key=KEY)  # keeps 4..7 + 3
    assert versions_in(store) == [3, 4, 5, 6, 7]
    assert_same(syncd.materialize(store, RUN, 4, signing_key=KEY), states[4])


def test_grace_period_protects_readers_of_a_superseded_version(eight):
    store, _ = eight
    created = {v: read_manifest(store, RUN, v, signing_key=KEY).created_datetime for v in range(8)}
    policy = RetentionPolicy(keep_last=2, grace_s=60)
    # a reader that picked 2 as newest may need 0-2 until 3 appeared (+ grace); 3-5 are in use until 6 appeared
    grace, half = timedelta(seconds=60), (created[6] - created[3]) / 2
    assert half > timedelta(0)
    plan = plan_retention(store, RUN, policy, signing_key=KEY, now=created[3] + grace - half)
    assert plan.delete_versions == []
    plan = plan_retention(store, RUN, policy, signing_key=KEY, now=created[3] + grace + half)
    assert plan.delete_versions == [0, 1, 2]
    plan = plan_retention(store, RUN, policy, signing_key=KEY, now=created[6] + grace + half)
    assert plan.delete_versions == [0, 1, 2, 3, 4, 5]
    assert plan.delete_keys[:6] == [mf.manifest_key(RUN, v) for v in range(6)]  # manifests go first


def test_orphans_are_removed_only_after_their_grace(eight):
    store, _ = eight
    prefix = mf.run_prefix(RUN)
    torn = prefix + mf.shard_key(8, "e" * 16, 0, "delta")  # a crashed upload of version 8
    stray = prefix + mf.shard_key(7, "d" * 16, 0, "delta")  # a losing publisher's shard in version 7
    store.put(torn, b"x")
    store.put(stray, b"y")
    policy = RetentionPolicy(keep_last=8, grace_s=0, orphan_grace_s=3600)
    assert apply_retention(store, RUN, policy, signing_key=KEY).delete_keys == []
    assert store.exists(torn) and store.exists(stray)
    late = store.head(torn).last_modified + timedelta(seconds=3601)
    plan = plan_retention(store, RUN, policy, signing_key=KEY, now=late)
    assert sorted(plan.delete_keys) == sorted([torn, stray]) and plan.delete_versions == []


def test_a_version_with_a_bad_manifest_is_reported_not_deleted(eight, tmp_path):
    store, _ = eight
    path = tmp_path / "s" / mf.manifest_key(RUN, 1)
    path.write_bytes(path.read_bytes().replace(b'"step":1', b'"step":9'))
    plan = apply_retention(store, RUN, RetentionPolicy(keep_last=1, grace_s=0), signing_key=KEY)
    assert 1 not in plan.delete_versions and store.exists(mf.manifest_key(RUN, 1))
    assert any("version 1: SignatureError" in p for p in plan.problems)


@pytest.mark.integration
def test_retention_under_concurrent_readers(tmp_path):
    """A publisher with aggressive retention and three readers materializing the newest version in a loop:
    a reader gets either exactly the right weights or a clean VersionNotFound (its version was deleted
    under it), never wrong data or any other error."""
    states = trajectory(24)
    store = Store(tmp_path / "s")
    done = threading.Event()
    outcomes, errors = [], []

    def reader():
        while not done.is_set():
            v = syncd.latest_version(store, RUN, signing_key=KEY)
            if v is None:
                continue
            try:
                got = syncd.materialize(store, RUN, v, signing_key=KEY)
            except VersionNotFound:
                outcomes.append("gone")
                continue
            except Exception as exc:  # noqa: BLE001 -- anything else fails the test below
                errors.append(repr(exc))
                continue
            try:
                assert_same(got, states[v])
                outcomes.append("ok")
            except AssertionError as exc:
                errors.append(f"version {v}: {exc}")

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    policy = RetentionPolicy(keep_last=2, grace_s=0, orphan_grace_s=0)
    with WeightPublisher(store, RUN, signing_key=KEY, full_every=4, shard_bytes=32 << 10,
                         retention=policy) as pub:
        for step, state in enumerate(states):
            pub.publish(state, step)
    done.set()
    for t in threads:
        t.join()
    assert errors == []
    assert outcomes.count("ok") > 0
    left = [i.version for i in list_versions(store, RUN, signing_key=KEY)]
    assert left[-2:] == [22, 23] and 0 not in left  # retention did delete while they read
    for v in left:
        assert_same(syncd.materialize(store, RUN, v, signing_key=KEY), states[v])
