"""The RL side's durable state: where every prompt is, and what happens to it after a restart.

A prompt is a task item index ``0, 1, 2, ...``. :class:`PromptLedger` knows the state of each:

* **fresh**: at or past the cursor (``next``), never requested;
* **in flight**: requested (``inflight[i]``: the attempt, trajectory ids, proxy, sandbox once known, the
  trainer version it was requested at);
* **buffered**: its group finished and waits in the rollout buffer;
* **planned**: its group is in the step being trained;
* **consumed**: trained in a committed step -- the per-prompt consumed bit, kept as ``low`` (every index below
  it is consumed) and the sorted indices above ``low`` that are (groups finish out of order);
* **to regenerate** (``retry``): its group was dropped (stale, over the buffer policy's cap, failed, or lost in
  flight) -- or a producer serving other prompts passed it over (``next_prompt(accept=)``); the next request
  takes it before any fresh prompt.

Every index below ``next`` is in exactly one of these states. The **frontier** (:meth:`PromptLedger.frontier`)
is the lowest index in flight or to regenerate (``next`` if none): every prompt below it has landed, so the prompts
below it are a sample of the prompt source fixed by dispatch order, not by generation speed (the buffer policy
measures its target mix on them, ``syncd.trainer.rl.buffer_policy``). A committed step moves its prompts to consumed,
so a restored run trains each prompt exactly once: never the consumed ones again (the TRL 7294 bug: a single
low-water cursor pinned by a dropped id replays everything after it), never skipping the others.

:func:`restore_groups` applies the buffer policy (:class:`syncd.trainer.rl.buffer_policy.BufferPolicy`, the same
one ``RolloutBuffer.take`` uses) after a restart, from one snapshot (``RolloutBuffer.snapshot``, saved in the step's
checkpoint): every buffered group is read back from the store and checked against the per-token versions the
snapshot recorded; a group within the staleness bound at the restored trainer version is **kept** (its importance
weights are computed at training time from the recorded engine log-probs, as for any stale group), an older one is
**dropped and counted** and its prompt regenerated, and so is the surplus over the policy's cap per version
(``dropped_cap``, taken from the strata most over their target mix), one whose records no longer
match or come from versions the restored trainer never published (a lost future) is dropped and regenerated
too; an in-flight group whose records all made it to the store before the crash is **recovered**, the others
are regenerated (their open trajectories closed by the caller). Buffered rollouts are never silently dropped on
resume (the OpenRLHF 1322 bug).

Not thread-safe by itself: :class:`syncd.trainer.rl.buffer.RolloutBuffer` calls it under its lock.
"""

from __future__ import annotations

import bisect
import logging
from collections import deque
from dataclasses import dataclass, field

from syncd.trainer.rl.buffer_policy import BufferPolicy

log = logging.getLogger(__name__)

__all__ = ["PromptLedger", "RestoreReport", "restore_groups", "LedgerError"]


class LedgerError(ValueError):
    """A ledger snapshot that is not one (malformed, or inconsistent with itself)."""


class PromptLedger:
    """See the module docstring."""

    def __init__(self):
        self.next = 0
        self.low = 0
        self.above: list[int] = []
        self.retry: deque[int] = deque()
        self.inflight: dict[int, dict] = {}
        self.attempts: dict[int, int] = {}
        self.buffered: set[int] = set()
        self.planned: set[int] = set()

    # ------------------------------------------------------------------------------------ transitions

    def next_prompt(self, accept=None, max_scan: int = 4096) -> tuple[int, int] | None:
        """``(index, attempt)`` to request next: a prompt to regenerate first, else a fresh one. ``accept(index)``:
        only prompts this producer serves (e.g. one engine cluster per task): the first accepted one to regenerate,
        else the next accepted fresh one, the fresh ones passed over queued (``retry``) for the other producers;
        None when none is accepted within ``max_scan`` fresh prompts (those stay queued: none is lost)."""
        if accept is None:
            index = self.retry.popleft() if self.retry else self._fresh()
        else:
            index = next((i for i in self.retry if accept(i)), None)
            if index is not None:
                self.retry.remove(index)
            else:
                for _ in range(max_scan):
                    i = self._fresh()
                    if accept(i):
                        index = i
                        break
                    self.retry.append(i)
                if index is None:
                    return None
        attempt = self.attempts.get(index, -1) + 1
        self.attempts[index] = attempt
        return index, attempt

    def frontier(self) -> int:
        """The lowest index in flight or to regenerate (``next`` if none): every prompt below it has landed."""
        return min(min(self.inflight, default=self.next), min(self.retry, default=self.next), self.next)

    def _fresh(self) -> int:
        self.next += 1
        return self.next - 1

    def started(self, index: int, entry: dict) -> None:
        self.inflight[index] = dict(entry)

    def finished(self, index: int, sandbox: str) -> None:
        """A record of the group was written (its sandbox id is now known: recovery can find the records)."""
        if index in self.inflight:
            self.inflight[index]["sandbox"] = sandbox

    def landed(self, index: int) -> None:
        """A group of ``index`` is in the buffer (from this ledger's dispatch, or from the rollout queue, whose
        service dispatches: the cursor then follows the prompts that landed)."""
        self.inflight.pop(index, None)
        self.buffered.add(index)
        self.next = max(self.next, index + 1)

    def failed(self, index: int) -> None:
        self.inflight.pop(index, None)
        self._requeue(index)

    def dropped(self, index: int) -> None:
        self.buffered.discard(index)
        self._requeue(index)

    def _requeue(self, index: int) -> None:
        if not self.is_consumed(index) and index not in self.retry:
            self.retry.append(index)

    def planned_for(self, indices) -> None:
        for i in indices:
            self.buffered.discard(i)
            self.planned.add(i)

    def consume(self, indices) -> None:
        """The step that trained ``indices`` committed."""
        for i in indices:
            self.planned.discard(i)
            self.buffered.discard(i)
            self.inflight.pop(i, None)
            self.attempts.pop(i, None)
            if i in self.retry:
                self.retry.remove(i)
            if i >= self.low and not self.is_consumed(i):
                bisect.insort(self.above, i)
        while self.above and self.above[0] == self.low:
            self.above.pop(0)
            self.low += 1

    def is_consumed(self, index: int) -> bool:
        if index < self.low:
            return True
        j = bisect.bisect_left(self.above, index)
        return j < len(self.above) and self.above[j] == index

    def consumed_count(self) -> int:
        return self.low + len(self.above)

    # ------------------------------------------------------------------------------------ snapshots

    def snapshot(self) -> dict:
        """JSON-able; planned prompts count as buffered (a snapshot is taken between steps)."""
        return {"next": self.next, "consumed_low": self.low, "consumed_above": list(self.above),
                "retry": list(self.retry), "inflight": {str(i): e for i, e in sorted(self.inflight.items())},
                "attempts": {str(i): a for i, a in sorted(self.attempts.items())}}

    @classmethod
    def from_snapshot(cls, doc: dict) -> "PromptLedger":
        """The ledger of ``doc`` with nothing buffered (the caller re-adds what it keeps); LedgerError."""
        try:
            led = cls()
            led.next, led.low = _nat(doc["next"]), _nat(doc["consumed_low"])
            led.above = sorted({_nat(i) for i in doc["consumed_above"]})
            led.retry = deque(dict.fromkeys(_nat(i) for i in doc["retry"]))
            led.inflight = {_nat(int(k)): dict(v) for k, v in doc["inflight"].items()}
            led.attempts = {_nat(int(k)): _nat(v) for k, v in doc["attempts"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise LedgerError(f"not a prompt ledger: {type(exc).__name__}: {exc}") from None
        if led.low > led.next or any(i < led.low or i >= led.next for i in led.above) \
                or any(i >= led.next for i in [*led.retry, *led.inflight]):
            raise LedgerError(f"inconsistent prompt ledger: cursor {led.next}, consumed below {led.low}")
        return led


def _nat(x) -> int:
    if not isinstance(x, int) or isinstance(x, bool) or x < 0:
        raise ValueError(f"{x!r} is not a non-negative integer")
    return x


@dataclass
class RestoreReport:
    """What :func:`restore_groups` did, by prompt index."""

    kept: list = field(default_factory=list)
    dropped_stale: list = field(default_factory=list)
    dropped_mismatch: list = field(default_factory=list)
    dropped_foreign: list = field(default_factory=list)
    recovered: list = field(default_factory=list)
    dropped_cap: list = field(default_factory=list)
    regenerated: list = field(default_factory=list)

    def counts(self) -> dict:
        return {k: len(v) for k, v in self.__dict__.items()}


def restore_groups(snapshot: dict, *, version: int, max_lag: int, newest_published: int, reread, recover,
                   policy: BufferPolicy | None = None) -> tuple[PromptLedger, list, RestoreReport]:
    """Apply the buffer policy to a snapshot (see the module docstring). ``version``: the restored trainer's
    version; ``newest_published``: the newest version the restored trainer's lineage has published (tokens of
    later versions come from a lost future); ``reread(group_doc) -> Group`` reads a buffered group back from the
    store, checked against its recorded per-token versions (raising ValueError/SyncdError when it cannot);
    ``recover(index, entry) -> Group | None`` rebuilds an in-flight group from records written before the crash;
    ``policy``: the restored buffer's (``RolloutBuffer.policy``; its state is loaded from the snapshot's), None:
    a default ``BufferPolicy(max_lag)`` with the snapshot's state. Returns ``(ledger, groups to put back in the
    buffer, report)``."""
    ledger = PromptLedger.from_snapshot(snapshot["ledger"])
    report, groups = RestoreReport(), []
    if policy is None:
        policy = BufferPolicy(max_lag)
    elif policy.max_lag != max_lag:
        raise ValueError(f"the policy's staleness bound {policy.max_lag} is not max_lag={max_lag}")
    policy.load_state_dict(snapshot.get("policy"))

    def judge(g, index) -> bool:
        newest_token = max(g.versions) if g.versions else g.requested_version
        if newest_token > newest_published:
            report.dropped_foreign.append(index)
        elif policy.is_stale(g, version):
            report.dropped_stale.append(index)
        else:
            return True
        ledger._requeue(index)
        return False

    for doc in snapshot.get("groups", []):
        index = doc["item"]["index"]
        if ledger.is_consumed(index):
            continue
        try:
            g = reread(doc)
        except Exception as exc:  # noqa: BLE001 -- whatever the store holds now, the prompt is regenerated
            log.warning("restore: buffered group of prompt %d unusable (%s); regenerating it", index, exc)
            report.dropped_mismatch.append(index)
            ledger._requeue(index)
            continue
        if judge(g, index):
            report.kept.append(index)
            groups.append(g)
            ledger.buffered.add(index)
    for index, entry in sorted(ledger.inflight.items()):
        g = None
        try:
            g = recover(index, entry)
        except Exception as exc:  # noqa: BLE001 -- not recoverable: regenerated
            log.info("restore: in-flight group of prompt %d not recovered: %s", index, exc)
        if g is not None and judge(g, index):
            report.recovered.append(index)
            groups.append(g)
            ledger.buffered.add(index)
        elif g is None:
            ledger._requeue(index)
    ledger.inflight.clear()
    for g in groups:
        policy.observe(g)
    policy.settle(ledger.frontier())
    sel = policy.admit(groups, version)  # the stale ones are judged above: what it drops is over the cap
    for g in (g for gs in sel.dropped.values() for g in gs):
        report.dropped_cap.append(g.item.index)
        ledger.buffered.discard(g.item.index)
        ledger._requeue(g.item.index)
    policy.count_drops(sel.dropped)
    report.regenerated = list(ledger.retry)
    return ledger, sel.keep, report
