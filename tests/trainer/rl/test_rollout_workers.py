"""Rollout workers survive every failure of a group: a proxy error, a reward that raises or returns NaN, records
that never reach the store. Each is counted by kind, the group's credit is given back (so it is replaced), its
trajectories still open in the proxy are finished marked dropped, nothing reaches the buffer, and the workers go on.
The proxy here is ``tests.trainer._fake_proxy`` (the real one is in test_loop_e2e.py)."""

from __future__ import annotations

import time

import pytest

from tests.trainer._fake_proxy import FakeProxy
from syncd.trainer.rl.buffer import RolloutBuffer
from syncd.trainer.rl.rollout_workers import ProxyError, RolloutWorkers, Sampling, complete
from syncd.trainer.rl.tasks import get_task


def _workers(tmp_path, proxy, reward, **kw):
    buf = RolloutBuffer(1)
    w = RolloutWorkers(proxies=[proxy.url], model_name="tiny", task=get_task("repeat"), reward=reward, group_size=4,
                       sampling=Sampling(1.0, 0.9, 20), store=(tmp_path / "store").as_uri(), run_id="rl", buffer=buf,
                       version=lambda: 3, step=lambda: 7, workers=1, seed=5, record_timeout_s=0.2, **kw)
    return w, buf


def _until(cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.mark.parametrize("case, kind, reward", [
    ("proxy error", "request", lambda s: 1.0),
    ("reward raises", "reward", lambda s: 1 / 0),
    ("reward is NaN", "reward", lambda s: float("nan")),
    ("no records in the store", "replay", lambda s: 0.5),
])
def test_a_failed_group_is_counted_replaced_and_closed(tmp_path, case, kind, reward):
    proxy = FakeProxy(500 if kind == "request" else 200)
    w, buf = _workers(tmp_path, proxy, reward)
    try:
        w.start()
        w.allow(1)
        _until(lambda: w.failures.totals.get(kind, 0) >= 2)  # failed, given its credit back, tried again, failed again
        stats = w.stats()
        assert stats["groups"] == 0 and len(buf) == 0 and all(t.is_alive() for t in w._threads)
        assert sum(stats["failures"].values()) == stats["failures"][kind]
        assert stats["last_error"].startswith("group ")
        first = sorted(t for t, _ in proxy.requests[:4])
        assert all(t.endswith(f"-g000000-s{j:02d}") for j, t in enumerate(first)), first
        _until(lambda: all(t in proxy.finished for t in first))
        meta = [proxy.finished[t] for t in first]
        if kind == "replay":  # finished with the reward, then the records never came
            assert all(m["reward"] == 0.5 and m["requested_version"] == 3 and m["step"] == 7 for m in meta)
        else:
            assert all("dropped" in m for m in meta), meta
        body = proxy.requests[0][1]
        assert body["top_p"] == 0.9 and body["top_k"] == 20 and body["max_tokens"] == 8 and body["ignore_eos"]
    finally:
        w.stop()
        proxy.close()


def test_requests_of_one_item_use_distinct_reproducible_seeds(tmp_path):
    proxy = FakeProxy(500)
    try:
        runs = []
        for _ in range(2):
            proxy.requests.clear()
            w, _ = _workers(tmp_path, proxy, lambda s: 0.0)
            w.start()
            w.allow(1)
            _until(lambda: len(proxy.requests) >= 4)
            w.stop()
            runs.append({t.rsplit("-", 1)[1]: b["seed"] for t, b in proxy.requests if "-g000000-" in t})
        assert runs[0] == runs[1] and len(set(runs[0].values())) == 4  # per sample, the same in both runs
        with pytest.raises(ProxyError, match="HTTP 500"):
            complete(proxy.url, {"prompt": "x"}, "t-1")
    finally:
        proxy.close()


def _curated_workers(tmp_path, proxy, task, reward):
    buf = RolloutBuffer(1)
    w = RolloutWorkers(proxies=[proxy.url], model_name="tiny", task=task, reward=reward, group_size=2,
                       sampling=Sampling(1.0, 0.9, 20), store=(tmp_path / "store").as_uri(), run_id="rl", buffer=buf,
                       version=lambda: 3, step=lambda: 7, workers=1, seed=5, record_timeout_s=0.2)
    return w, buf


def test_an_exhausted_curation_pool_stops_the_workers_with_the_cause(tmp_path):
    from syncd.trainer.rl.buffer import BufferClosed
    from syncd.trainer.rl.curation import CuratedTask, CurationConfig

    task = CuratedTask(get_task("repeat"), CurationConfig(pool=2, recheck_after=0))
    for k in range(2):
        task.curator.observe(k, [1.0] * 10)  # both too easy, and never rechecked
    proxy = FakeProxy()
    w, buf = _curated_workers(tmp_path, proxy, task, lambda s: 1.0)
    try:
        w.start()
        w.allow(1)
        with pytest.raises(BufferClosed):  # the trainer's wait ends (before: retried every 5 s, forever)
            buf.take(1, 3, timeout_s=20)
        for t in w._threads:
            t.join(10)
        assert not any(t.is_alive() for t in w._threads)
        assert "curation.band" in w.stats()["last_error"] and w.failures.totals == {"task": 1}
        assert proxy.requests == []
    finally:
        w.stop()
        proxy.close()


def test_curation_sees_only_the_rewards_of_groups_that_reached_the_buffer(tmp_path):
    from syncd.trainer.rl.buffer import Group
    from syncd.trainer.rl.curation import CuratedTask, CurationConfig

    task = CuratedTask(get_task("repeat"), CurationConfig(pool=4))
    proxy = FakeProxy()  # its records never reach the store: every group is dropped after its rewards
    w, buf = _curated_workers(tmp_path, proxy, task, lambda s: 1.0)
    try:
        w.start()
        w.allow(1)
        _until(lambda: w.failures.totals.get("replay", 0) >= 2)
        assert task.stats()["draws"] >= 2 and not task.curator.estimates()  # dropped groups moved no estimate
    finally:
        w.stop()
        proxy.close()
    # the hook itself: a group that is put in the buffer is observed once, with its rewards
    task = CuratedTask(get_task("repeat"), CurationConfig(pool=4))
    w, buf = _curated_workers(tmp_path, FakeProxy(), task, lambda s: 1.0)
    w._group = lambda index, attempt=0: Group(index, task.item(index), [("s", f"t{index}")] * 2, [1.0, 0.0])
    try:
        w.start()
        w.allow(3)
        _until(lambda: len(buf) == 3)
        _until(lambda: sum(e.attempts for e in task.curator.estimates()) == 6)
        assert sorted((e.task_id, e.attempts, e.solved) for e in task.curator.estimates()) == \
            [(0, 2, 1), (1, 2, 1), (2, 2, 1)]
    finally:
        w.stop()



@pytest.mark.parametrize("bad", [dict(temperature=float("inf")), dict(temperature=float("nan")),
                                 dict(temperature=0.0), dict(top_p=float("nan")), dict(top_k=-1)])
def test_sampling_refuses_what_no_engine_can_sample(bad):
    """An infinite temperature used to be accepted, and the run failed only when the rollouts timed out (300 s)."""
    with pytest.raises(ValueError, match="must be"):
        Sampling(**bad)
