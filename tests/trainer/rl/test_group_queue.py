"""The rollout queue's ledger without engines (a file store): claims before sending, recovery after a crash at any
point (orphans failed and sent again, fresh prompts after the highest claimed, group numbers without gaps), the
trainer's returns, two copies of one service, a share of several services, and hostile objects refused by name.
The service with real engines, proxy and kill -9 is tests/trainer/rl/test_rollout_service.py."""

from __future__ import annotations

import json
import re
import threading
from types import SimpleNamespace

import pytest

from syncd.errors import ObjectExists
from syncd.trainer.rl.group_queue import PAGE, GroupQueue, QueueError
from syncd.trainer.rl.queue_ledger import QueueSink

RUN = "q"


@pytest.fixture
def queue(tmp_path):
    (tmp_path / "store").mkdir()
    return GroupQueue((tmp_path / "store").as_uri(), RUN)


def _sink(queue, service="svc", share=(0, 1)) -> QueueSink:
    return QueueSink(queue, service, share=share, stop=threading.Event())


def _entry(index, attempt):
    return {"trajectories": [f"t{index}-{attempt}-{j}" for j in range(2)], "proxy": "http://127.0.0.1:1"}


def _group(index, attempt):
    plan = {"gid": index, "item": {"index": index, "prompt": "p", "target": None, "meta": {}},
            "trajectories": [["sb", f"t{index}-{attempt}-{j}"] for j in range(2)], "rewards": [0.0, 1.0],
            "versions": {"0": 4}, "tokens": 4, "requested_version": 0, "requested_at": 0.0, "finished_at": 0.0}
    return SimpleNamespace(plan=lambda: plan, token_versions=[[0, 0], [0, 0]], attempt=attempt,
                           item=SimpleNamespace(index=index))


def test_every_attempt_is_claimed_before_it_is_sent_and_never_twice(queue):
    s = _sink(queue)
    assert [s.next_prompt(_entry) for _ in range(3)] == [(0, 0), (1, 0), (2, 0)]
    with pytest.raises(ObjectExists):
        queue.claim(1, 0, _entry(1, 0))
    other = _sink(queue)  # a second copy of the service, started on the same queue without recovering
    assert other.next_prompt(_entry) == (0, 1)  # its (0, 0) was claimed: failed, and the next attempt sent
    assert queue.state("svc").failed == {(0, 0): "failed"}


def test_a_restart_fails_the_orphans_sends_them_again_first_and_continues_after_the_highest(queue):
    s = _sink(queue)
    for _ in range(5):
        s.next_prompt(_entry)  # prompts 0..4 in flight
    assert s.put(_group(0, 0)) and s.put(_group(2, 0))
    s.failed(3)  # failed in the service: sent again as attempt 1
    assert s.next_prompt(_entry) == (3, 1)
    closed = []
    r = _sink(queue)  # the service killed here and restarted
    found = r.recover(closed.append)
    assert found["orphaned"] == 3 and found["landed"] == 2 and found["next_seq"] == 2
    assert sorted((c["index"], c["attempt"]) for c in closed) == [(1, 0), (3, 1), (4, 0)]  # trajectories closed
    assert [r.next_prompt(_entry) for _ in range(4)] == [(1, 1), (3, 2), (4, 1), (5, 0)]
    assert r.put(_group(1, 1))
    assert [d["item"]["index"] for d in queue.read_groups("svc", 0)[0]] == [0, 2, 1]  # numbered on, no gap
    reasons = {k: json.loads(queue.store.get(queue.failed_key(*k)))["reason"] for k in [(1, 0), (3, 0), (3, 1)]}
    assert reasons[(1, 0)].startswith("orphaned") and reasons[(3, 0)].startswith("the group failed")


def test_a_group_the_trainer_returns_is_sent_again_once(queue):
    s = _sink(queue)
    s.next_prompt(_entry)
    s.put(_group(0, 0))
    assert s.poll_returned() == 0
    assert queue.fail(0, 0, "dropped: stale", by="trainer") and not queue.fail(0, 0, "again", by="trainer")
    assert s.poll_returned() == 1 and s.poll_returned() == 0
    assert s.next_prompt(_entry) == (0, 1)
    assert s.put(_group(0, 1))
    r = _sink(queue)  # a restart does not send it again: its return was answered by attempt 1
    assert r.recover(lambda claim: None)["regenerate"] == 0
    assert r.next_prompt(_entry) == (1, 0)


def test_services_split_the_prompts_by_share(queue):
    a, b = _sink(queue, "a", (0, 2)), _sink(queue, "b", (1, 2))
    assert [a.next_prompt(_entry)[0] for _ in range(3)] == [0, 2, 4]
    assert [b.next_prompt(_entry)[0] for _ in range(2)] == [1, 3]
    r = _sink(queue, "a", (0, 2))
    r.recover(lambda claim: None)
    assert r.stats()["regenerate"] == 3 and r.cursor == 6  # its own orphans only, and its next fresh prompt


def test_a_consumer_reads_in_order_across_pages_and_stops_at_a_gap(queue):
    for seq in list(range(PAGE + 3)) + [PAGE + 5]:
        queue.append("svc", seq, {**_group(seq, 0).plan(), "attempt": 0})
    docs, nxt = queue.read_groups("svc", PAGE - 2, limit=10)
    assert [d["seq"] for d in docs] == [PAGE - 2, PAGE - 1, PAGE, PAGE + 1, PAGE + 2] and nxt == PAGE + 3
    assert queue.read_groups("svc", nxt) == ([], nxt)
    queue.set_consumer({"svc": nxt}, step=3)
    assert queue.consumer()["read"] == {"svc": nxt} and queue.consumer()["step"] == 3


@pytest.mark.parametrize("edit, what", [
    (lambda d: d.update(attempt=1), "name another group"),
    (lambda d: d.update(rewards=[0.0]), r"one \[sandbox, trajectory\] pair per reward"),
    (lambda d: d.update(rewards=[0.0, "x"]), "finite numbers"),
    (lambda d: d.pop("trajectories"), "'trajectories' must be"),
    (lambda d: d.update(service="other"), "name another group"),
])
def test_a_group_object_that_does_not_check_is_refused_naming_its_key(queue, edit, what):
    key = queue.append("svc", 0, {**_group(0, 0).plan(), "attempt": 0})
    doc = json.loads(queue.store.get(key))
    edit(doc)
    queue.store.put(key, json.dumps(doc).encode())
    (err,), nxt = queue.read_groups("svc", 0)
    assert isinstance(err, QueueError) and re.search(what, str(err)) and key in str(err) and nxt == 1
    assert GroupQueue.attempt_of(err) == (0, 0)  # the consumer can send the attempt back


def test_hostile_names_and_contents_are_skipped_by_recovery(queue):
    s = _sink(queue)
    s.next_prompt(_entry)
    queue.store.put(queue.prefix + "attempts/junk.json", b"{}")
    queue.store.put(queue.attempt_key(7, 0), b"[1, 2]")  # not an object
    queue.store.put(queue.prefix + "consumer.json", b'{"read": {"svc": -1}}')
    st = queue.state("svc")
    assert set(st.claims) == {(0, 0), (7, 0)} and list(st.skipped) == [queue.prefix + "attempts/junk.json"]
    with pytest.raises(QueueError, match="not a JSON object"):
        queue.read_claim(7, 0)
    closed = []
    found = _sink(queue).recover(closed.append)  # the unreadable orphan is failed and sent again, not closed
    assert found["orphaned"] == 2 and [c["index"] for c in closed] == [0]
    with pytest.raises(QueueError, match="consumer.json"):
        queue.consumer()
