"""The trainer's side of the rollout queue on a file store, with the real ``RolloutBuffer`` (no engines: the groups
are written as a service writes them, ``rebuild`` makes them from their docs): read in order from every service,
the position written for the services' backlog, a restart from an older position that skips what was sent back or
trained, and everything not trained -- unreadable, malformed, dropped by the buffer policy -- sent back."""

from __future__ import annotations

import json

import pytest

from syncd.trainer.rl.buffer import Group, RolloutBuffer
from syncd.trainer.rl.group_queue import GroupQueue
from syncd.trainer.rl.queue_feed import QueueFeed
from syncd.trainer.rl.tasks import TaskItem

RUN = "feed"


@pytest.fixture
def queue(tmp_path):
    (tmp_path / "store").mkdir()
    return GroupQueue((tmp_path / "store").as_uri(), RUN)


def _doc(index, attempt=0, version=0, frontier=0):
    return {"gid": index, "item": {"index": index, "prompt": "p", "target": None, "meta": {}},
            "trajectories": [["sb", f"t{index}-{attempt}-{j}"] for j in range(2)], "rewards": [0.0, 1.0],
            "versions": {str(version): 4}, "tokens": 4, "requested_version": version, "requested_at": 0.0,
            "finished_at": float(index), "token_versions": [[version] * 2] * 2, "attempt": attempt,
            "frontier": frontier}


def _rebuild(doc):
    if doc["item"]["prompt"] == "unreadable":
        raise ValueError("the records are gone")
    it = doc["item"]
    return Group(doc["gid"], TaskItem(it["index"], it["prompt"]), [tuple(t) for t in doc["trajectories"]],
                 doc["rewards"], [], {int(k): v for k, v in doc["versions"].items()}, doc["tokens"],
                 doc["requested_version"], finished_at=doc["finished_at"])


def _feed(queue, eta=2, positions=None):
    holder = {}
    buf = RolloutBuffer(eta, on_drop=lambda gs: holder["feed"].send_back_groups(gs),
                        frontier=lambda: holder["feed"].frontier())
    holder["feed"] = QueueFeed(queue, buf, _rebuild, positions=positions, step=lambda: 7, version=lambda: 3)
    return holder["feed"], buf


def _returned(queue) -> dict:
    return {(int(i.key[-19:-9]), int(i.key[-8:-5])): json.loads(queue.store.get(i.key))
            for i in queue.store.list(queue.prefix + "failed/")}


def test_groups_are_read_in_order_from_every_service_and_the_position_written(queue):
    for seq, i in enumerate([0, 2, 4]):
        queue.append("a", seq, _doc(i, frontier=i + 2))
    queue.append("b", 0, _doc(1, frontier=3))
    feed, buf = _feed(queue)
    assert feed.poll() == 4 and len(buf) == 4
    assert feed.positions() == {"a": 3, "b": 1} and feed.frontier() == 3
    assert queue.consumer()["read"] == {"a": 3, "b": 1} and queue.consumer()["step"] == 7
    queue.append("a", 3, _doc(6, frontier=8))
    assert feed.poll() == 1 and feed.positions()["a"] == 4
    assert sorted(g.item.index for g in buf.take(5, version=0, timeout_s=1)) == [0, 1, 2, 4, 6]


def test_a_restart_from_an_older_position_skips_what_was_sent_back_or_trained(queue):
    for seq in range(4):
        queue.append("a", seq, _doc(seq))
    feed, buf = _feed(queue)
    feed.poll()
    (g0,) = buf.take(1, version=0, timeout_s=1)
    buf.consume([g0.item.index])  # trained in a committed step ...
    assert queue.fail(1, 0, "dropped: stale", by="trainer")  # ... and prompt 1 sent back, after the checkpoint
    again, buf2 = _feed(queue, positions={"a": 0})  # restored from a checkpoint taken before both
    buf2.ledger.consume([0])  # (the checkpoint's ledger says which prompts were trained)
    assert again.poll() == 2 and sorted(g.item.index for g in buf2.take(2, version=0, timeout_s=1)) == [2, 3]
    assert again.stats()["skipped_held"] == 1 and again.stats()["skipped_returned"] == 1


def test_what_is_not_trained_is_sent_back_with_its_reason(queue):
    queue.append("a", 0, _doc(0))
    queue.append("a", 1, {**_doc(1), "item": {**_doc(1)["item"], "prompt": "unreadable"}})
    key = queue.append("a", 2, _doc(2))
    queue.store.put(key, b'{"not": "a group"}')  # malformed
    queue.append("a", 3, _doc(3, version=0))
    feed, buf = _feed(queue, eta=0)
    assert feed.poll() == 2
    with pytest.raises(TimeoutError):
        buf.take(1, version=1, timeout_s=0.1)  # both groups are a version behind eta 0: dropped stale
    feed.stop()  # flushes what the buffer dropped
    back = _returned(queue)
    assert set(back) == {(0, 0), (1, 0), (2, 0), (3, 0)} and all(d["by"] == "trainer" for d in back.values())
    assert back[(1, 0)]["reason"].startswith("not read back") and back[(2, 0)]["reason"].startswith("malformed")
    assert feed.stats()["errors"]["malformed"] == 1 and feed.stats()["sent_back"] == 4


def test_the_position_says_what_waits_in_the_buffer_and_is_written_when_asked(queue):
    queue.append("a", 0, _doc(0))
    queue.append("a", 1, _doc(1))
    feed, buf = _feed(queue)
    feed.auto_publish = False  # a synchronous step writes it once the engines serve its version
    feed.lookahead = 3
    assert feed.poll() == 2
    beat = queue.consumer()  # the heartbeat: what waits in the buffer, the read position shown before
    assert beat["read"] == {} and beat["held"] == {"a": 2} and beat["lookahead"] == 3
    buf.take(1, version=0, timeout_s=1)
    feed.publish_position()
    assert queue.consumer()["read"] == {"a": 2} and queue.consumer()["held"] == {"a": 1}
    assert queue.consumer()["t"] > beat["t"]
    again, buf2 = _feed(queue, positions={"a": 0})  # read again after a restart: what is buffered is skipped
    buf2.put(_rebuild(_doc(1)))
    assert again.poll() == 1 and again.stats()["skipped_held"] == 1
