"""The whole path against an S3-compatible server on loopback: publish, poll, materialize, retention and the
CLI. (Two publishers racing for a version, on every store: ``test_publisher_race.py``.)"""

from __future__ import annotations

import json

import pytest

import syncd
from syncd import manifest as mf
from syncd.app.cli import main as cli
from syncd.store import Store
from syncd.retention import RetentionPolicy, apply_retention
from syncd.versions import list_versions, poll_latest
from syncd.publish.publisher import WeightPublisher

from ._models import assert_same, trajectory
from .conftest import KEY

pytestmark = pytest.mark.integration
RUN = "s3run"


def test_publish_poll_materialize_and_retain_over_s3(s3_url):
    store = Store(s3_url, part_bytes=1 << 16)
    states = trajectory(6)
    assert poll_latest(store, RUN, signing_key=KEY) == (None, None)
    with WeightPublisher(store, RUN, signing_key=KEY, full_every=3, shard_bytes=32 << 10) as pub:
        pub.publish(states[0], 0)
        pub.flush()
        version, etag = poll_latest(store, RUN, signing_key=KEY)
        assert version == 0 and etag
        assert poll_latest(store, RUN, etag, signing_key=KEY) is None  # conditional GET: not modified
        for step in range(1, 6):
            pub.publish(states[step], step)
    assert poll_latest(store, RUN, etag, signing_key=KEY)[0] == 5
    for v in range(6):
        assert_same(syncd.materialize(s3_url, RUN, v, signing_key=KEY), states[v])
    plan = apply_retention(store, RUN, RetentionPolicy(keep_last=1, grace_s=0), signing_key=KEY)
    assert plan.delete_versions == [0, 1, 2] and [i.version for i in list_versions(store, RUN)] == [3, 4, 5]
    assert_same(syncd.materialize(store, RUN, signing_key=KEY), states[5])


def test_poll_latest_does_not_trust_a_forged_hint(s3_url):
    store = Store(s3_url)
    with WeightPublisher(store, RUN, signing_key=KEY) as pub:
        for step, state in enumerate(trajectory(2)):
            pub.publish(state, step)
    store.put(mf.latest_hint_key(RUN), json.dumps({"version": 99}).encode())
    assert poll_latest(store, RUN, signing_key=KEY)[0] == 1
    store.put(mf.latest_hint_key(RUN), json.dumps({"version": 0}).encode())  # stale: walks forward
    assert poll_latest(store, RUN, signing_key=KEY)[0] == 1


def test_cli_against_s3_with_endpoint_flag(s3_endpoint, s3_url, monkeypatch, capsys):
    with WeightPublisher(s3_url, RUN, signing_key=KEY) as pub:
        pub.publish(trajectory(1)[0], 0)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # wrong; the flag must win
    monkeypatch.setenv("SYNCD_SIGNING_KEY", KEY)
    assert cli(["verify", "--store", s3_url, "--endpoint", s3_endpoint, "--run-id", RUN]) == 0
    assert "1 versions checked, 0 failed" in capsys.readouterr().out
