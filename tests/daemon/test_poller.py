"""syncd.daemon.poller on a real file store: conditional GETs of the hint, a lagging or malformed hint,
backoff while the store fails."""

from __future__ import annotations

import asyncio
import os

import pytest

from syncd import manifest as mf
from syncd.daemon.poller import Poller
from syncd.errors import StoreError
from syncd.store import RetryPolicy, Store
from syncd.versions import read_manifest
from tests.daemon.conftest import KEY, RUN, Published


def poller(store, **kw):
    seen = []
    p = Poller(store, RUN, read=lambda v: read_manifest(store, RUN, v, signing_key=KEY),
               interval_s=kw.get("interval_s", 0.01), jitter=0.2, backoff_max_s=kw.get("backoff", 0.08),
               list_every_s=kw.get("list_every_s", 3600), on_candidate=seen.append)
    return p, seen


def test_hint_changes_are_noticed_with_conditional_gets(tmp_path, published):
    published.publish(2)
    p, _ = poller(published.store)
    assert p.poll_once() == 1
    assert p.poll_once() is None  # unchanged hint: nothing new (one conditional GET)
    published.publish(1)
    assert p.poll_once() == 2


def test_a_lagging_or_malformed_hint_is_not_trusted(tmp_path, published):
    published.publish(3)
    store = published.store
    store.put(mf.latest_hint_key(RUN), b'{"version": 0}')  # lags two versions behind the manifests
    p, _ = poller(store)
    assert p.poll_once() == 2
    store.put(mf.latest_hint_key(RUN), b'{"version": "nine"}')
    assert p.poll_once() == 2  # falls back to the listing
    store.put(mf.latest_hint_key(RUN), b'{"version": 77}')  # points nowhere
    assert p.poll_once() == 2
    store.delete(mf.latest_hint_key(RUN))
    assert p.poll_once() == 2


def test_backoff_while_the_store_fails_then_catch_up(tmp_path):
    root = tmp_path / "store"
    pub = Published(root)
    pub.publish(1)
    store = Store(root, retry=RetryPolicy(attempts=1, http_retries=0))
    p, seen = poller(store, interval_s=0.01, backoff=0.08)
    errors = []
    p.on_error = errors.append

    async def main():
        stop = asyncio.Event()
        task = asyncio.ensure_future(p.run(stop))
        while not seen:
            await asyncio.sleep(0.01)
        os.rename(root, tmp_path / "away")  # the store becomes unreachable
        root.write_bytes(b"")
        while len(errors) < 4:
            await asyncio.sleep(0.01)
        delays = [p.next_delay() for _ in range(50)]
        assert max(delays) <= 0.08 and min(delays) >= 0.04  # capped exponential backoff, jittered
        root.unlink()
        os.rename(tmp_path / "away", root)
        pub.publish(1)
        while seen[-1] != 1:
            await asyncio.sleep(0.01)
        assert p.failures == 0
        stop.set()
        await task

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        pub.close()
    assert seen == [0, 1] and all(isinstance(e, StoreError) for e in errors)


def test_run_ids_are_checked():
    with pytest.raises(ValueError, match="run id"):
        Poller(None, "../x", read=print, interval_s=1, jitter=0, backoff_max_s=1, list_every_s=1,
               on_candidate=print)
