"""The rollout buffer: finished groups wait here until a training step takes them, unless they grew too stale.

A :class:`Group` is the ``G`` completions of one task item, as read back from the store, with their rewards.
Its **lag** at trainer version ``v`` is ``v - (the oldest weight version of any generated token in it)``: the
largest version lag of any token of any of its samples. Which groups :meth:`RolloutBuffer.take` hands out, and
which it drops, is the buffer's :class:`syncd.trainer.rl.buffer_policy.BufferPolicy` (the one mechanism, in steady
state and after a restart): the staleness bound ``eta`` (``max_lag``; ``eta = 0`` trains on-policy only, larger
values let generation run ahead of training), a cap per generating version, and a quota that holds the trained
mix of tasks and lengths to the prompt source's own, oldest-first within it -- oldest-first within eta whenever
every group is of one stratum (one fixed-length task). Every drop is counted by reason (:attr:`RolloutBuffer.dropped`;
``dropped_stale`` the stale ones) and ``on_drop(groups)`` is called, so that a producer can replace them. Groups are
dropped whole, since their advantages are normalised within the group.

:func:`group_advantages`: ``(r - mean) / (std + eps)`` within each group (population std), or ``r - mean``
with ``scale=False``; a group whose rewards are all equal has advantages 0 (it carries no signal).

The buffer also keeps the run's :class:`syncd.trainer.rl.rl_state.PromptLedger` under its lock (which prompt is fresh,
in flight, buffered, planned, consumed or to be regenerated): producers ask it for the next prompt
(:meth:`RolloutBuffer.next_prompt`), report a failure (:meth:`failed`), and a dropped group -- or one the buffer's
``vet`` refuses -- sends the prompt back to be regenerated, so that no prompt is lost. :meth:`snapshot` is the
buffer's part of the RL-state checkpoint (the ledger, every buffered group with its per-token versions, the policy's
state), taken atomically between two steps; :meth:`restore` puts back what
:func:`syncd.trainer.rl.rl_state.restore_groups` kept.

Thread-safety: every :class:`RolloutBuffer` method may be called from any thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from syncd.trainer.rl.buffer_policy import BufferPolicy
from syncd.trainer.rl.rl_state import PromptLedger
from syncd.trainer.rl.tasks import TaskItem

log = logging.getLogger(__name__)

__all__ = ["Group", "RolloutBuffer", "group_advantages", "BufferClosed"]


class BufferClosed(RuntimeError):
    """The buffer was closed while a caller waited for groups."""


@dataclass
class Group:
    """One task item's ``G`` samples. ``trajectories``: ``(sandbox_id, trajectory_id)`` per sample, in sample
    order; ``rewards``: one per sample; ``rollouts``: the :class:`syncd.trainer.rl.rollouts.Rollout` s read back (None
    once dropped from memory, e.g. on ranks that read them themselves); ``versions``: ``{version: tokens}`` over
    the generated tokens; ``tokens``: generated tokens; ``requested_version``: the trainer's version when the
    group was requested; times are ``time.time()``; ``token_versions``: per sample, the version of each generated
    token; ``attempt``: how many times this prompt was requested before (regenerations)."""

    gid: int
    item: TaskItem
    trajectories: list[tuple[str, str]]
    rewards: list[float]
    rollouts: list | None = None
    versions: dict[int, int] = field(default_factory=dict)
    tokens: int = 0
    requested_version: int = 0
    requested_at: float = 0.0
    finished_at: float = 0.0
    token_versions: list | None = None
    attempt: int = 0

    @property
    def oldest_version(self) -> int:
        return min(self.versions) if self.versions else self.requested_version

    def lag(self, version: int) -> int:
        return version - self.oldest_version

    def plan(self) -> dict:
        """The JSON-able description a training step records and sends to the other ranks."""
        return {"gid": self.gid, "item": {"index": self.item.index, "prompt": self.item.prompt,
                                          "target": self.item.target, "meta": self.item.meta},
                "trajectories": [list(t) for t in self.trajectories], "rewards": list(self.rewards),
                "versions": {str(k): v for k, v in sorted(self.versions.items())}, "tokens": self.tokens,
                "requested_version": self.requested_version, "requested_at": self.requested_at,
                "finished_at": self.finished_at}


def group_advantages(rewards, *, scale: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Advantages of one group's rewards (float64 in, float32 out; see the module docstring)."""
    r = torch.as_tensor(rewards, dtype=torch.float64)
    if r.ndim != 1 or r.numel() < 1:
        raise ValueError("a group needs a 1-D list of at least one reward")
    if not bool(torch.isfinite(r).all()):
        raise ValueError(f"rewards must be finite, got {r.tolist()}")
    a = r - r.mean()
    std = r.std(unbiased=False)
    if float(std) <= eps:
        return torch.zeros_like(r, dtype=torch.float32)
    return (a / (std + eps) if scale else a).to(torch.float32)


class RolloutBuffer:
    """Groups waiting for a training step (see the module docstring). ``max_lag``: the staleness bound eta;
    ``policy``: the :class:`~syncd.trainer.rl.buffer_policy.BufferPolicy` (default: ``BufferPolicy(max_lag)``; its
    eta is the buffer's); ``on_drop(groups)``: called (under the buffer's lock: it must not call back into the
    buffer, nor wait on I/O) with the groups just dropped (stale, over the cap per version, refused);
    ``frontier()``: the lowest prompt index not yet landed, where the prompts come from elsewhere than the
    buffer's own ledger (the rollout service's queue); default the ledger's. ``vet(group) -> group``: the last
    check of a finished group before it may be planned, called by :meth:`put` in the producer's thread (outside
    the lock); it may return the group changed (e.g. its kept sets resolved) or raise: the group is then
    **refused** -- counted by error class in :attr:`refused`, logged, its prompt regenerated."""

    def __init__(self, max_lag: int, *, on_drop=None, vet=None, policy: BufferPolicy | None = None,
                 frontier=None):
        if max_lag < 0:
            raise ValueError(f"the staleness bound must be >= 0, got {max_lag}")
        if policy is not None and policy.max_lag != max_lag:
            raise ValueError(f"the policy's staleness bound {policy.max_lag} is not the buffer's {max_lag}")
        self.max_lag = max_lag
        self.policy = policy if policy is not None else BufferPolicy(max_lag)
        self.on_drop, self.vet, self._frontier = on_drop, vet, frontier
        self.refused: dict[str, int] = {}
        self.dropped: dict[str, int] = {}
        self._groups: deque[Group] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self.ledger = PromptLedger()
        self.added = 0
        self.taken = 0

    @property
    def dropped_stale(self) -> int:
        return self.dropped.get("stale", 0)

    def __len__(self) -> int:
        with self._cond:
            return len(self._groups)

    def next_prompt(self, entry_of=None, accept=None) -> tuple[int, int] | None:
        """``(index, attempt)`` of the prompt to generate next, registered as in flight (``entry_of(index,
        attempt)`` -> the ledger entry: trajectory ids, proxy, requested version); ``accept(index)``: only a prompt
        this producer serves (e.g. its task's; :meth:`PromptLedger.next_prompt`), None when none was found."""
        with self._cond:
            got = self.ledger.next_prompt(accept)
            if got is not None:
                self.ledger.started(got[0], entry_of(*got) if entry_of is not None else {})
            return got

    def holds(self, index: int) -> bool:
        """Whether prompt ``index`` is buffered, planned or consumed (a group of it read again is not needed)."""
        with self._cond:
            led = self.ledger
            return index in led.buffered or index in led.planned or led.is_consumed(index)

    def indices(self) -> list[int]:
        """The prompts of the buffered groups."""
        with self._cond:
            return [g.item.index for g in self._groups]

    def record_written(self, index: int, sandbox: str) -> None:
        with self._cond:
            self.ledger.finished(index, sandbox)

    def failed(self, index: int) -> None:
        """The in-flight group of ``index`` failed: its prompt is regenerated."""
        with self._cond:
            self.ledger.failed(index)

    def put(self, group: Group) -> bool:
        """Buffer a finished group, once ``vet`` passed it; False when it was refused (or the buffer is closed)."""
        if self.vet is not None:
            try:
                group = self.vet(group)
            except Exception as exc:  # noqa: BLE001 -- whatever the check raises, the group is refused and replaced
                log.warning("rollout group of prompt %d refused: %s: %s", group.item.index, type(exc).__name__, exc)
                with self._cond:
                    self.refused[type(exc).__name__] = self.refused.get(type(exc).__name__, 0) + 1
                    self.ledger.failed(group.item.index)
                    if self.on_drop is not None:
                        self.on_drop([group])
                return False
        with self._cond:
            if self._closed:
                return False
            self._groups.append(group)
            self.ledger.landed(group.item.index)
            self.policy.observe(group)
            self.added += 1
            self._cond.notify_all()
            return True

    def consume(self, indices) -> None:
        """The step that trained the prompts ``indices`` committed."""
        with self._cond:
            self.ledger.consume(indices)

    def remove(self, indices) -> int:
        """Take the groups of ``indices`` out (a plan already made for them, e.g. logged by an earlier life);
        returns how many were here."""
        want = set(indices)
        with self._cond:
            keep = deque(g for g in self._groups if g.item.index not in want)
            n = len(self._groups) - len(keep)
            self._groups = keep
            self.ledger.planned_for(want)
            return n

    def snapshot(self) -> dict:
        """The ledger, every buffered group (its plan and per-token versions) and the policy's state, atomically."""
        with self._cond:
            return {"ledger": self.ledger.snapshot(),
                    "groups": [{**g.plan(), "token_versions": g.token_versions, "attempt": g.attempt}
                               for g in self._groups],
                    "dropped_stale": self.dropped_stale, "dropped": dict(self.dropped),
                    "policy": self.policy.state_dict()}

    def restore(self, ledger: PromptLedger, groups: list[Group], dropped_stale: int = 0, *,
                dropped: dict | None = None) -> None:
        """Replace the ledger and the buffered groups with a restored run's
        (:func:`syncd.trainer.rl.rl_state.restore_groups`, which applied the policy); the policy observes them.
        ``dropped``: the drop counters by reason (``dropped_stale`` overrides its ``stale``)."""
        with self._cond:
            self.ledger = ledger
            self._groups = deque(sorted(groups, key=lambda g: g.finished_at))
            self.dropped = {k: int(v) for k, v in (dropped or {}).items()}
            if dropped_stale:
                self.dropped["stale"] = dropped_stale
            for g in self._groups:
                self.policy.observe(g)
            self._cond.notify_all()

    def stats(self) -> dict:
        """JSON-able: buffered, added, taken, drops by reason, refused, and the policy's :meth:`BufferPolicy.stats`."""
        with self._cond:
            return {"buffered": len(self._groups), "added": self.added, "taken": self.taken,
                    "dropped": dict(self.dropped), "refused": dict(self.refused), "policy": self.policy.stats()}

    def _drop(self, dropped: dict) -> None:
        """Drop the policy's choice (under the lock): counted by reason, prompts regenerated, ``on_drop``."""
        out = {id(g) for gs in dropped.values() for g in gs}
        if not out:
            return
        self._groups = deque(g for g in self._groups if id(g) not in out)
        for reason, gs in dropped.items():
            self.dropped[reason] = self.dropped.get(reason, 0) + len(gs)
            for g in gs:
                self.ledger.dropped(g.item.index)
            if reason != "stale":
                log.info("buffer policy dropped %d group(s): %s", len(gs), reason)
        self.policy.count_drops(dropped)
        if self.on_drop is not None:
            self.on_drop([g for gs in dropped.values() for g in gs])

    def take(self, n: int, version: int, *, timeout_s: float | None = None) -> list[Group]:
        """``n`` groups at trainer ``version`` as the policy selects them (oldest-first within eta and the quota;
        the module docstring), waiting for them as long as needed (at most ``timeout_s``: TimeoutError). Raises
        :class:`BufferClosed` once :meth:`close` was called."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while True:
                if self._closed:
                    raise BufferClosed("the rollout buffer was closed")
                self.policy.settle(self.ledger.frontier() if self._frontier is None else self._frontier())
                force = self.policy.patience_over()
                sel = self.policy.select(list(self._groups), n, version, force=force)
                self._drop(sel.dropped)
                if len(sel.take) == n:
                    out = {id(g) for g in sel.take}
                    self._groups = deque(g for g in self._groups if id(g) not in out)
                    self.ledger.planned_for(g.item.index for g in sel.take)
                    self.taken += n
                    self.policy.took(sel.take, version, forced=force)
                    return sel.take
                if sel.blocked:
                    self.policy.blocked()
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"{len(self._groups)} of {n} rollout groups after {timeout_s:.0f} s"
                                       + (" (held back by the buffer policy's quota)" if sel.blocked else ""))
                self._cond.wait(0.5 if left is None else min(0.5, left))

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
