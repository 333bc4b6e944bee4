"""A store an attacker can write to does not stop a cluster of real node processes: a forged, deeply nested
``latest.json``, a garbage manifest at a far-future version (with the hint pointing there), a manifest signed
with another key and a replayed one are each skipped and reported, never taken as the newest version; the
nodes reach every newest valid version, and no long-lived task of any node dies."""

from __future__ import annotations

import threading
import time

import pytest

from syncd import manifest as mf
from tests.cluster._util import RUN, assert_in_order, assert_no_task_errors, weights_from_cache
from tests.cluster.conftest import Publisher
from tests.store._models import assert_same

pytestmark = [pytest.mark.integration, pytest.mark.slow]

FAR = mf.MAX_VERSION - 1  # 999999999998


def _manifest_path(store, v: int):
    return store / mf.manifest_key(RUN, v)


def _forge(store, v: int, body: bytes) -> None:
    path = _manifest_path(store, v)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(body)


class HintForger:
    """Rewrites ``latest.json`` with ``body`` every few milliseconds (the trainer rewrites it at every
    publish; the forger wins almost every read)."""

    def __init__(self, store, body: bytes):
        self.path, self.body = store / mf.latest_hint_key(RUN), body
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            tmp = self.path.with_suffix(".forged")
            tmp.write_bytes(self.body)
            tmp.replace(self.path)
            self._stop.wait(0.005)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(5)


def test_forged_hint_and_unusable_manifests_do_not_stop_the_cluster(tmp_path, states, make_cluster):
    store = tmp_path / "store"
    pub = Publisher(store, states)
    for _ in range(3):
        pub.next()  # versions 0 (full), 1, 2
    # the attacker's writes before the cluster starts: a garbage manifest far in the future, a manifest
    # signed with another key, an older version's manifest replayed under a new number, and a hint that is
    # "[" * 4096 (RecursionError in a plain json.loads)
    _forge(store, FAR, b"not a manifest")
    _forge(store, FAR - 1, _manifest_path(store, 1).read_bytes().replace(b'"version":1}', b'"version":%d}' % (FAR - 1)))
    _forge(store, 7, _manifest_path(store, 2).read_bytes())
    c = make_cluster(3, store)
    with HintForger(store, b"[" * 4096):
        c.start_all()
        c.wait(lambda: all(2 in c.delivered(r) for r in range(3)), 40, "version 2 (the newest valid) on every node")
        v3 = pub.next()  # published while the hint is forged: found by probing after the newest known version
        c.wait(lambda: all(v3 in c.delivered(r) for r in range(3)), 40, f"version {v3} on every node")
    with HintForger(store, b'{"version": %d}' % FAR):  # the hint names the garbage manifest
        v4 = pub.next()
        published = time.monotonic()
        c.wait(lambda: all(v4 in c.delivered(r) for r in range(3)), 40, f"version {v4} on every node")
        delay = time.monotonic() - published
    pub.close()
    print(f"hostile store: version {v4} on every node {delay:.2f} s after its publish (poll interval 0.2 s)")
    for r in range(3):
        assert c.delivered(r) == [0, 1, 2, 3, 4], f"node {r}: every valid version, in order, nothing else"
        assert_in_order(c, r)
    assert_same(weights_from_cache(c.cache(1), store, v4), states[v4])
    # each unusable version was skipped and reported once by the controller, the hint reported as unusable
    bad = {e["v"]: e["why"] for r in range(3) for e in c.events(r, "bad_version")}
    assert set(bad) == {FAR, FAR - 1, 7}, bad
    assert "not valid JSON" in bad[FAR] and "signature" in bad[FAR - 1] and "version" in bad[7]
    assert any("nested deeper" in e["why"] for r in range(3) for e in c.events(r, "bad_hint"))
    assert not any(e["v"] >= 7 for r in range(3) for e in c.events(r, "latest")), "an unusable version as newest"
    assert_no_task_errors(c, range(3))
