"""Readers against a hostile store (issue 14, cases 1 and 2): whatever an attacker writes -- a deeply nested,
huge or garbage ``latest.json``, garbage, replayed or unsigned manifests at any version number, far into the
future -- the newest version a reader reports is always one whose manifest verified, on the file store and
on the S3 server on loopback; and every read is bounded (size, depth) with a named error."""

from __future__ import annotations

import json

import pytest

from syncd import manifest as mf
from syncd.jsonsafe import JSONError
from syncd.newest import VersionPoller, parse_hint
from syncd.store import Store
from syncd.versions import latest_version, poll_latest, read_manifest
from syncd.publish.publisher import WeightPublisher

from ._models import trajectory
from .conftest import KEY

RUN = "hostile"


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path):
    if request.param == "file":
        return Store(tmp_path / "store")
    return Store(request.getfixturevalue("s3_url"))


def publisher(store) -> WeightPublisher:
    """One publisher session for the whole test (a new session numbers its first version after the highest
    directory, so the hostile directories below are written while this one is open)."""
    return WeightPublisher(store, RUN, signing_key=KEY, full_every=3, shard_bytes=32 << 10)


def publish(pub, steps) -> None:
    for step in steps:
        pub.publish(trajectory(8)[step], step)
    pub.flush()


@pytest.mark.parametrize("raw, match", [
    (b"[" * 4096, "nested deeper"),
    (b'{"version": {"v": {"w": 1}}}', "nested deeper than 2"),
    (b'{"version": 1e400}', "non-integer number"),
    (b'{"version": NaN}', "NaN is not a JSON value"),
    (b" " * 5000, "over the limit of 4096"),
    (b'["version", 3]', "not a hint"),
    (b'{"version": -1}', "not a hint"),
    (b"\xff\xfe", "not UTF-8"),
])
def test_a_hint_is_parsed_within_bounds_with_a_named_error(raw, match):
    with pytest.raises(JSONError, match=match):
        parse_hint(raw, "latest.json")
    assert parse_hint(b'{"run_id": "r", "version": 7, "step": 3}', "latest.json") == 7


@pytest.mark.integration
def test_a_forged_hint_never_stops_polling(store):
    """Case 1: one write of ``"[" * 4096`` to the hint made the poller die; now it lists and goes on."""
    with publisher(store) as pub:
        publish(pub, range(2))
        hint = mf.latest_hint_key(RUN)
        for forged in (b"[" * 4096, b"x" * (1 << 20), b'{"version": 1.5}', b'{"version": -1}', b"\xff\xfe"):
            store.put(hint, forged)
            assert poll_latest(store, RUN, signing_key=KEY)[0] == 1
        etag = poll_latest(store, RUN, signing_key=KEY)[1]
        assert poll_latest(store, RUN, etag, signing_key=KEY) is None  # one conditional GET while unchanged
        publish(pub, range(2, 3))
        assert poll_latest(store, RUN, etag, signing_key=KEY)[0] == 2  # the publisher rewrote the hint


@pytest.mark.integration
def test_far_future_garbage_is_skipped_never_a_high_water_mark(store):
    """Case 2: garbage at version 999999999998 with the hint pointing there was adopted as the newest version;
    later real versions were never noticed. Now it is skipped, and real later versions are found."""
    from dataclasses import replace

    far = 999999999998
    with publisher(store) as pub:
        publish(pub, range(2))
        store.put(mf.manifest_key(RUN, far), b"not a manifest")
        store.put(mf.latest_hint_key(RUN), json.dumps({"version": far}).encode())
        assert poll_latest(store, RUN, signing_key=KEY)[0] == 1
        assert latest_version(store, RUN, signing_key=KEY) == 1
        # replayed (a real manifest copied to a later number) and unsigned forgeries are skipped the same way
        store.put(mf.manifest_key(RUN, far - 1), store.get(mf.manifest_key(RUN, 1)))
        m0 = read_manifest(store, RUN, 0, signing_key=KEY)
        moved = tuple(replace(s, key=s.key.replace(mf.version_dir(0), mf.version_dir(far - 2))) for s in m0.shards)
        store.put(mf.manifest_key(RUN, far - 2), replace(m0, version=far - 2, shards=moved).encode(None))
        publish(pub, range(2, 4))
        store.put(mf.latest_hint_key(RUN), json.dumps({"version": far}).encode())
        assert latest_version(store, RUN, signing_key=KEY) == 3
        assert poll_latest(store, RUN, signing_key=KEY)[0] == 3


def test_a_poller_walks_past_many_garbage_versions_within_a_few_polls(tmp_path):
    """More garbage directories above the real versions than one poll may read: a few polls, not a stall."""
    store = Store(tmp_path / "store")
    with publisher(store) as pub:
        publish(pub, range(2))
    for v in range(10**6, 10**6 + 40):
        store.put(mf.manifest_key(RUN, v), b"{}")
    store.delete(mf.latest_hint_key(RUN))  # (a valid hint would be taken at once: only the listing is left)
    skipped = []
    poller = VersionPoller(store, RUN, read=lambda v: read_manifest(store, RUN, v, signing_key=KEY), max_reads=16,
                           on_skip=lambda v, exc: skipped.append(v))
    found = [poller.poll() for _ in range(3)]
    assert found == [None, None, 1], found  # 16 reads per poll: 40 garbage versions, then version 1
    assert sorted(skipped) == list(range(10**6, 10**6 + 40))  # each read once, reported once
    assert poller.poll() == 1 and len(skipped) == 40  # remembered: not read again


def test_a_poller_walks_past_many_empty_version_directories_within_a_few_polls(tmp_path):
    """Directories without a manifest (torn, or squatted) far above the real versions: each is read once per
    listing interval, so the walk gets past them in a few polls instead of reading the same first ones forever;
    the next versions right above the newest one are never skipped that way."""
    store = Store(tmp_path / "store")
    with publisher(store) as pub:
        publish(pub, range(2))
        for v in range(10**6, 10**6 + 40):
            store.put(mf.manifest_key(RUN, v).replace("manifest.json", "shards/x.sdelta"), b"torn")
        store.delete(mf.latest_hint_key(RUN))
        reads = []

        def read(v):
            reads.append(v)
            return read_manifest(store, RUN, v, signing_key=KEY)

        poller = VersionPoller(store, RUN, read=read, max_reads=16)
        assert [poller.poll() for _ in range(3)] == [None, None, 1]
        assert sorted(reads) == sorted(list(range(10**6, 10**6 + 40)) + [1])  # each empty one read once
        store.put(mf.manifest_key(RUN, 2).replace("manifest.json", "shards/x.sdelta"), b"upload in progress")
        assert poller.poll() == 1  # version 2 has no manifest yet
        publish(pub, [2])
        store.delete(mf.latest_hint_key(RUN))
        poller._last_list = float("-inf")  # the next listing is due
        assert poller.poll() == 2  # right above the newest: read again, not remembered as missing
