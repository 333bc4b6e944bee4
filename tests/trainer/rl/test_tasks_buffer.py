"""The thin trainer's tasks, reward interface, rollout buffer and group-normalised advantages (pure Python/torch)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from syncd.trainer.rl.buffer import BufferClosed, Group, RolloutBuffer, group_advantages
from syncd.trainer.rl.tasks import TASKS, Sample, TaskItem, get_task, load_reward


def _sample(task, index, text, **kw):
    return Sample(task.item(index), text, **kw)


def test_items_are_deterministic_and_differ_by_seed():
    t = get_task("repeat")
    assert [t.item(i, seed=3) for i in range(20)] == [t.item(i, seed=3) for i in range(20)]
    assert [t.item(i, seed=3).prompt for i in range(20)] != [t.item(i, seed=4).prompt for i in range(20)]
    it = t.item(7)
    assert it.prompt[1] == ":" and it.target == it.prompt[0] * 8 and it.prompt[0] in "abcd"


@pytest.mark.parametrize("name", sorted(TASKS))
def test_rewards_are_in_unit_interval_and_perfect_answers_score_one(name):
    t = get_task(name, length=6)
    for i in range(10):
        item = t.item(i)
        perfect = item.target if item.target is not None else "abcdef"
        assert t.reward(Sample(item, perfect)) == 1.0
        for junk in ("", "\ufffd\ufffd", "ZZZZZZZZZZZZ", perfect + "extra tail"):
            r = t.reward(Sample(item, junk))
            assert 0.0 <= r <= 1.0
    assert t.reward(Sample(t.item(0), "")) == 0.0


def test_repeat_and_reverse_rewards_by_hand():
    rep = get_task("repeat", length=4)
    item = TaskItem(0, "c:", "cccc")
    assert rep.score(item, "cccc") == 1.0
    assert rep.score(item, "ccab") == pytest.approx(0.5 * 1.0 + 0.5 * 0.5)   # all in the alphabet, 2 of 4 right
    assert rep.score(item, "xxcc") == pytest.approx(0.5 * 0.5 + 0.5 * 0.5)
    assert rep.score(item, "cc") == pytest.approx(0.5 * 0.5 + 0.5 * 0.5)     # missing characters count as wrong
    rev = get_task("reverse", length=3)
    assert rev.score(TaskItem(0, "abd:", "dba"), "dba") == 1.0
    assert rev.score(TaskItem(0, "abd:", "dba"), "abd") == pytest.approx(0.5 + 0.5 / 3)
    assert get_task("letters", length=4).score(TaskItem(0, "xyz:"), "ab1?") == 0.5


def test_the_mix_task_alternates_a_short_and_a_4x_longer_task_and_names_each_items_task_and_length():
    mix = get_task("mix", length=3)
    items = [mix.item(i) for i in range(6)]
    assert [it.meta["task"] for it in items] == ["repeat", "reverse"] * 3
    assert [mix.max_tokens_for(it) for it in items] == [3, 12] * 3 and mix.max_tokens == 12
    assert all(len(it.target) == mix.max_tokens_for(it) for it in items)
    rev = items[1]
    assert rev.target == rev.prompt[:-1][::-1] and mix.score(rev, rev.target) == 1.0
    # a hostile or missing length in a read-back item's meta falls back to the short answer, never past the longest
    for meta in ({}, {"max_tokens": 10 ** 6}, {"max_tokens": True}, {"max_tokens": "12"}):
        assert mix.max_tokens_for(TaskItem(1, "ab:", "ba", meta)) == 3
    assert get_task("repeat").max_tokens_for(items[1]) == 8  # a task of one length ignores the meta


def test_unknown_task_and_bad_rewards_are_named():
    with pytest.raises(ValueError, match="unknown task 'nope'; choose one of letters, mix, repeat, reverse"):
        get_task("nope")
    with pytest.raises(ValueError, match="at least one token"):
        get_task("repeat", length=0)
    with pytest.raises(ValueError, match="MODULE:ATTRIBUTE"):
        load_reward("no_colon")
    with pytest.raises(ValueError, match="cannot load reward"):
        load_reward("syncd.trainer.rl.tasks:missing")
    with pytest.raises(ValueError, match="is not callable"):  # a class is instantiated once: a Task is no RewardFn
        load_reward("syncd.trainer.rl.tasks:RepeatTask")


def test_load_reward_gives_a_callable_on_samples(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text("def half(sample):\n    return 0.5 if sample.completion else 0.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = load_reward("my_rewards:half")
    t = get_task("repeat")
    assert fn(_sample(t, 0, "x")) == 0.5 and fn(_sample(t, 0, "")) == 0.0


def test_group_advantages():
    a = group_advantages([1.0, 0.0, 0.0, 1.0])
    assert torch.allclose(a, torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5)
    assert a.dtype == torch.float32 and float(a.sum()) == pytest.approx(0.0, abs=1e-6)
    assert torch.equal(group_advantages([0.3, 0.3, 0.3]), torch.zeros(3))  # no signal: zero, not NaN
    assert torch.allclose(group_advantages([2.0, 0.0], scale=False), torch.tensor([1.0, -1.0]))
    with pytest.raises(ValueError, match="finite"):
        group_advantages([1.0, float("nan")])


def _group(gid, versions, requested=0):
    return Group(gid, TaskItem(gid, "a:"), [("sb", f"t{gid}-{j}") for j in range(2)], [0.0, 1.0],
                 versions={v: 4 for v in versions}, tokens=8 * len(versions), requested_version=requested)


def test_buffer_drops_groups_beyond_the_staleness_bound_and_reports_them():
    dropped = []
    buf = RolloutBuffer(1, on_drop=lambda gs: dropped.append(len(gs)))
    buf.put(_group(0, [0]))          # lag 3 at version 3: dropped
    buf.put(_group(1, [1, 2]))       # its oldest token is 2 behind: dropped
    buf.put(_group(2, [2, 3]))       # lag 1: kept
    buf.put(_group(3, [3]))
    got = buf.take(2, version=3, timeout_s=1)
    assert [g.gid for g in got] == [2, 3]
    assert buf.dropped_stale == 2 and dropped == [2] and buf.taken == 2 and len(buf) == 0
    assert _group(9, [], requested=5).lag(6) == 1  # no tokens yet: its request version counts
    with pytest.raises(ValueError, match="staleness bound"):
        RolloutBuffer(-1)


def test_buffer_take_waits_times_out_and_closes():
    buf = RolloutBuffer(0)
    threading.Timer(0.2, lambda: buf.put(_group(5, [4]))).start()
    t0 = time.monotonic()
    assert [g.gid for g in buf.take(1, version=4, timeout_s=10)] == [5]
    assert time.monotonic() - t0 >= 0.15
    with pytest.raises(TimeoutError, match="0 of 1 rollout groups"):
        buf.take(1, version=4, timeout_s=0.1)
    threading.Timer(0.1, buf.close).start()
    with pytest.raises(BufferClosed):
        buf.take(1, version=4)


def test_group_plan_is_json():
    import json

    g = _group(3, [1, 2])
    doc = json.loads(json.dumps(g.plan()))
    assert doc["gid"] == 3 and doc["trajectories"] == [["sb", "t3-0"], ["sb", "t3-1"]]
    assert doc["versions"] == {"1": 4, "2": 4} and doc["rewards"] == [0.0, 1.0]


def test_a_group_the_buffers_vet_refuses_is_counted_and_its_prompt_regenerated():
    """The live side's last check of a finished group (records of a version never published, kept sets that cannot
    be rebuilt): a refused group never reaches a plan, its credit is given back (on_drop), it is counted by error
    class, and its prompt is the next one requested; what the check returns is what is buffered."""
    from syncd.trainer.rl.rollouts import UnpublishedVersionError

    def vet(g):
        if g.gid == 1:
            raise UnpublishedVersionError("claims version 9")
        g.rewards = [r + 1 for r in g.rewards]
        return g

    dropped = []
    buf = RolloutBuffer(2, on_drop=lambda gs: dropped.append([g.item.index for g in gs]), vet=vet)
    for _ in range(3):
        buf.next_prompt()
    assert buf.put(_group(0, [0])) and not buf.put(_group(1, [0])) and buf.put(_group(2, [0]))
    assert buf.refused == {"UnpublishedVersionError": 1} and dropped == [[1]] and len(buf) == 2
    assert list(buf.ledger.retry) == [1] and 1 not in buf.ledger.inflight and buf.next_prompt() == (1, 1)
    assert [g.rewards for g in buf.take(2, version=0, timeout_s=1)] == [[1.0, 2.0], [1.0, 2.0]]
