"""The RL state across restarts (``syncd.trainer.rl.rl_state`` with the real ``syncd.trainer.rl.buffer.RolloutBuffer``):
property tests over random runs killed at random points, and the public restart bugs as named cases.

A run is a random sequence of what the live side does -- request a prompt, a group's records land in the store and
its group in the buffer, a record is written but the process dies before the group lands, a request fails, a step
takes groups and commits (its checkpoint written, or skipped because the previous one is still being written), the
store loses a record -- and ``kill``: everything in memory is gone, the run restarts from its newest checkpoint
(the snapshot ``RolloutBuffer.snapshot`` saved with the step) through :func:`restore_groups`. What must hold after
any such run: every prompt the restored lineage trained is trained once (none twice), the ledger's consumed bits
are exactly the lineage's prompts, and every prompt below the cursor is in exactly one place (consumed, buffered,
in flight or to be regenerated): none is lost. The real kill -9 of the trainer process is in test_resume.py."""

from __future__ import annotations

import copy

from hypothesis import given, settings
from hypothesis import strategies as st

from syncd.trainer.rl.buffer import Group, RolloutBuffer
from syncd.trainer.rl.rl_state import LedgerError, PromptLedger, restore_groups
from syncd.trainer.rl.tasks import TaskItem

import pytest

GROUPS_PER_STEP, MAX_LAG = 2, 1


class Sim:
    """The live side's RL state in one process, with a dict standing in for the object store's records (they survive
    a kill; nothing else does)."""

    def __init__(self):
        self.records: dict[tuple[int, int], int] = {}  # (prompt, attempt) -> version its tokens came from
        self.ckpt = {"version": 0, "lineage": [], "buffer": RolloutBuffer(MAX_LAG).snapshot()}
        self.report = None
        self._fresh_process(self.ckpt)

    def _fresh_process(self, ckpt) -> None:
        self.buffer = RolloutBuffer(MAX_LAG)
        self.version, self.lineage = ckpt["version"], copy.deepcopy(ckpt["lineage"])

    def group(self, index: int, attempt: int, version: int) -> Group:
        tv = [[version] * 3 for _ in range(2)]
        return Group(gid=index, item=TaskItem(index, f"p{index}"), trajectories=[("sb", f"{index}-r{attempt}-{j}")
                                                                                 for j in range(2)],
                     rewards=[0.0, 1.0], versions={version: 6}, tokens=6, requested_version=version,
                     token_versions=tv, attempt=attempt)

    # ---------------------------------------------------------------- what the live side does

    def request(self) -> None:
        self.buffer.next_prompt(lambda i, a: {"attempt": a, "trajectories": [f"{i}-r{a}-{j}" for j in range(2)],
                                              "requested_version": self.version})

    def _inflight(self, pick: int):
        inflight = sorted(self.buffer.ledger.inflight.items())
        return inflight[pick % len(inflight)] if inflight else (None, None)

    def land(self, pick: int) -> None:
        index, entry = self._inflight(pick)
        if index is not None:
            self.records[(index, entry["attempt"])] = entry["requested_version"]
            self.buffer.record_written(index, "sb")
            self.buffer.put(self.group(index, entry["attempt"], entry["requested_version"]))

    def record_only(self, pick: int) -> None:  # the records are written, the process dies before the group lands
        index, entry = self._inflight(pick)
        if index is not None:
            self.records[(index, entry["attempt"])] = entry["requested_version"]
            self.buffer.record_written(index, "sb")

    def fail(self, pick: int) -> None:
        index, _ = self._inflight(pick)
        if index is not None:
            self.buffer.failed(index)

    def lose_record(self, pick: int) -> None:
        if self.records:
            del self.records[sorted(self.records)[pick % len(self.records)]]

    def step(self, checkpoint: bool) -> None:
        try:
            groups = self.buffer.take(GROUPS_PER_STEP, self.version, timeout_s=0)
        except TimeoutError:
            return
        indices = [g.item.index for g in groups]
        self.buffer.consume(indices)  # the step committed
        self.lineage.append(indices)
        self.version += 1  # a version per step (K = 1)
        if checkpoint:
            self.ckpt = {"version": self.version, "lineage": copy.deepcopy(self.lineage),
                         "buffer": copy.deepcopy(self.buffer.snapshot())}

    def kill(self) -> None:
        ckpt = self.ckpt
        self._fresh_process(ckpt)

        def reread(doc):
            index, attempt = doc["item"]["index"], doc["attempt"]
            if (index, attempt) not in self.records:
                raise ValueError(f"the records of prompt {index} are gone")
            return self.group(index, attempt, self.records[(index, attempt)])

        def recover(index, entry):
            v = self.records.get((index, entry["attempt"]))
            return None if v is None or not entry.get("sandbox") else self.group(index, entry["attempt"], v)

        ledger, groups, self.report = restore_groups(ckpt["buffer"], version=self.version, max_lag=MAX_LAG,
                                                     newest_published=self.version, reread=reread, recover=recover)
        self.buffer.restore(ledger, groups)

    # ---------------------------------------------------------------- what must hold

    def check(self) -> None:
        led = self.buffer.ledger
        trained = [i for step in self.lineage for i in step]
        assert len(trained) == len(set(trained)), f"a prompt trained twice: {self.lineage}"
        consumed = {i for i in range(led.next) if led.is_consumed(i)}
        assert consumed == set(trained)
        buffered = {g.item.index for g in self.buffer._groups}
        places = [consumed, buffered, set(led.inflight), set(led.retry)]
        for i in range(led.next):
            assert sum(i in p for p in places) == 1, (i, places)  # exactly one place: none lost, none twice
        assert not led.planned  # between steps


OPS = st.lists(st.one_of(st.just(("request",)), st.tuples(st.just("land"), st.integers(0, 7)),
                         st.tuples(st.just("record_only"), st.integers(0, 7)),
                         st.tuples(st.just("fail"), st.integers(0, 7)),
                         st.tuples(st.just("lose_record"), st.integers(0, 7)),
                         st.tuples(st.just("step"), st.booleans()), st.just(("kill",))), max_size=80)


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_no_prompt_is_lost_or_trained_twice_across_random_kills(ops):
    sim = Sim()
    for op, *args in ops:
        getattr(sim, op)(*args)
        sim.check()
    sim.kill()  # and once more at the very end
    sim.check()
    for _ in range(30):  # the restored run can finish everything it holds, each prompt once
        for _ in range(GROUPS_PER_STEP):
            sim.request()
            sim.land(0)
        sim.step(True)
        sim.check()


def test_openrlhf_1322_buffered_rollouts_are_not_dropped_on_resume():
    sim = Sim()
    for _ in range(5):
        sim.request()
        sim.land(0)
    sim.step(True)  # trains prompts 0, 1; 2, 3, 4 wait in the buffer and are in the checkpoint
    sim.kill()
    assert sorted(g.item.index for g in sim.buffer._groups) == [2, 3, 4]
    assert sim.report.kept == [2, 3, 4] and not sim.report.regenerated
    sim.step(True)
    assert sim.lineage == [[0, 1], [2, 3]]


def test_trl_7294_a_stale_dropped_prompt_does_not_pin_the_cursor():
    sim = Sim()
    sim.request()  # prompt 0, requested on version 0, lands late
    for late in (False, False, True):
        if late:
            sim.land(0)  # lag 2 at version 2 > the bound: the next step drops it (stale) and requeues it
        for _ in range(GROUPS_PER_STEP):
            sim.request()
            sim.land(-1)
        sim.step(True)
    assert sim.lineage == [[1, 2], [3, 4], [5, 6]] and sim.buffer.dropped_stale == 1
    trained = sorted(i for s in sim.lineage for i in s)
    sim.kill()
    led = sim.buffer.ledger
    assert list(led.retry) == [0] and led.next == 7  # 0 regenerated once; 1..6 never replayed
    index, attempt = led.next_prompt()
    assert (index, attempt) == (0, 1)  # attempt r1: a new trajectory id, not the dropped one's
    assert led.next_prompt()[0] == 7
    assert all(led.is_consumed(i) for i in trained)


def test_a_lost_future_is_regenerated_and_stale_groups_are_counted():
    sim = Sim()
    for _ in range(3):
        sim.request()
    sim.land(0)
    sim.record_only(0)  # its records made it to the store before the crash: recovered
    sim.step(True)  # not enough groups: no step
    sim.ckpt = {"version": 0, "lineage": [], "buffer": copy.deepcopy(sim.buffer.snapshot())}
    sim.kill()
    assert sorted(sim.report.kept) == [0] and sim.report.recovered == [1] and sim.report.regenerated == [2]
    snap = copy.deepcopy(sim.ckpt["buffer"])
    snap["groups"][0]["versions"] = {"5": 6}  # tokens of a version the restored trainer never published

    ledger, groups, report = restore_groups(snap, version=0, max_lag=MAX_LAG, newest_published=0,
                                            reread=lambda d: sim.group(0, 0, 5), recover=lambda i, e: None)
    assert report.dropped_foreign == [0] and not groups and 0 in ledger.retry


def test_a_malformed_ledger_is_refused_with_the_reason():
    led = PromptLedger().snapshot()
    with pytest.raises(LedgerError, match="not a prompt ledger"):
        PromptLedger.from_snapshot({**led, "next": -1})
    with pytest.raises(LedgerError, match="inconsistent prompt ledger"):
        PromptLedger.from_snapshot({**led, "next": 2, "retry": [5]})
