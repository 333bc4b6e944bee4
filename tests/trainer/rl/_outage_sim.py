"""A trainer outage, simulated with real threads on a discrete-event clock, feeding the real RolloutBuffer.

:class:`SimClock` runs real threads one at a time: a thread blocks in ``sleep(dt)`` (simulated time) or
``park(predicate)``; the driver releases the parked thread whose predicate holds (oldest first), else the earliest
sleeper (moving the clock to its wake time), and waits until every thread is blocked again. So a run is the same on
an idle machine and on a busy one, and takes seconds for minutes of simulated time.

:class:`OutageSim` is the rollout pipeline of ``docs/trainer.md`` ("The buffer after an outage"): a prompt source
mixing tasks by fixed shares (prompt ``i``'s task drawn from its index and the seed), one engine cluster per task
(``workers`` threads each, a task's groups taking ``gen_s[task]`` seconds, jittered), the real
:class:`~syncd.trainer.rl.buffer.RolloutBuffer` and its prompt ledger, and a trainer thread taking ``n`` groups per
step (a version per step). While the trainer lives, generation is paced by its credit (``lookahead`` groups ahead,
handed out in the ledger's order: the source's mix); while it is away the pipeline stays warm: every cluster's idle
engine takes the next prompt of its own task (``next_prompt(accept=)``) up to ``max_backlog`` groups, so the faster
task piles up. At the restart the buffer keeps its policy (``after_restart="policy"``) or is handed the naive
oldest-first one (``"naive"``): both runs are the same up to that moment, on the same backlog.
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from syncd.trainer.rl.buffer import Group, RolloutBuffer
from syncd.trainer.rl.buffer_policy import BufferPolicy
from syncd.trainer.rl.tasks import TaskItem


class _Stop(BaseException):
    pass


class SimClock:
    """See the module docstring."""

    def __init__(self):
        self.now = 0.0
        self._cond = threading.Condition()
        self._blocked: dict[int, tuple] = {}
        self._go: set[int] = set()
        self._running = self._seq = 0
        self._stopping = False
        self._threads: list[threading.Thread] = []
        self.errors: list[BaseException] = []

    def spawn(self, fn, name: str) -> None:
        with self._cond:
            self._running += 1

        def body():
            try:
                fn()
            except _Stop:
                pass
            except BaseException as exc:  # noqa: BLE001 -- handed to the driver
                self.errors.append(exc)
            finally:
                with self._cond:
                    self._running -= 1
                    self._cond.notify_all()

        t = threading.Thread(target=body, name=name, daemon=True)
        self._threads.append(t)
        t.start()

    def _block(self, kind: str, value) -> None:
        with self._cond:
            if self._stopping:
                raise _Stop
            self._seq += 1
            me = self._seq
            self._blocked[me] = (kind, value)
            self._running -= 1
            self._cond.notify_all()
            while me not in self._go:
                self._cond.wait()
            self._go.discard(me)
            if self._stopping:
                raise _Stop

    def sleep(self, dt: float) -> None:
        self._block("t", self.now + dt)

    def park(self, predicate) -> None:
        self._block("p", predicate)

    def run(self, until: float, timeout_s: float = 300.0) -> None:
        """Run the threads until simulated time ``until`` (or until none is left)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                while self._running > 0:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"simulation stuck at t={self.now}")
                    self._cond.wait(1.0)
                if self.errors:
                    raise self.errors[0]
                ready = next((me for me, (k, v) in sorted(self._blocked.items()) if k == "p" and v()), None)
                if ready is None:
                    timers = [(v, me) for me, (k, v) in self._blocked.items() if k == "t"]
                    if not timers or min(timers)[0] > until:
                        self.now = until
                        return
                    wake, ready = min(timers)
                    self.now = max(self.now, wake)
                del self._blocked[ready]
                self._running += 1
                self._go.add(ready)
                self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            for me in list(self._blocked):
                self._running += 1
                self._go.add(me)
            self._blocked.clear()
            self._cond.notify_all()
        for t in self._threads:
            t.join(10)


@dataclass
class SimConfig:
    seed: int = 0
    mix: dict = field(default_factory=lambda: {"A": 0.5, "B": 0.5})
    gen_s: dict = field(default_factory=lambda: {"A": 1.0, "B": 4.0})  # A is 4x faster to generate
    tokens: dict = field(default_factory=lambda: {"A": 8, "B": 64})   # per sample
    workers: int = 4          # engines per task's cluster
    n: int = 8                # groups per step
    step_s: float = 1.0       # a training step
    lookahead: int = 16       # credit while the trainer lives
    max_backlog: int = 400    # groups ahead while it is away
    max_lag: int = 8
    steps: int = 34
    fail_after: int = 20      # the trainer dies after this many steps...
    outage_s: float | None = 30.0  # ...for this long (None: no outage)
    after_restart: str = "policy"  # or "naive"


class OutageSim:
    """See the module docstring. :meth:`run` -> ``self``: ``trained`` (per step: the tasks of its groups),
    ``restart_step``, ``restart_backlog`` (the buffered prompts at the restart), ``buffer``."""

    def __init__(self, cfg: SimConfig):
        self.cfg = cfg
        self.clock = SimClock()
        self.buffer = RolloutBuffer(cfg.max_lag, on_drop=self._credit_back,
                                    policy=BufferPolicy(cfg.max_lag, clock=lambda: self.clock.now))
        self.credit, self.version, self.free_run = cfg.lookahead, 0, False
        self.queues = {t: deque() for t in cfg.mix}
        self.trained: list[list[str]] = []
        self.lineage: list[int] = []
        self.restart_step, self.restart_backlog = None, None

    def task_of(self, index: int) -> str:
        u, acc = random.Random(f"{self.cfg.seed}:task:{index}").random(), 0.0
        for task, share in self.cfg.mix.items():
            acc += share
            if u < acc:
                return task
        return task

    def _credit_back(self, groups: list) -> None:
        self.credit += len(groups)

    def _backlog(self) -> int:
        return len(self.buffer.ledger.inflight) + len(self.buffer)

    def _dispatcher(self) -> None:
        while True:
            self.clock.park(lambda: not self.free_run and self.credit > 0)
            self.credit -= 1
            index, attempt = self.buffer.next_prompt()
            self.queues[self.task_of(index)].append((index, attempt))

    def _worker(self, task: str, k: int) -> None:
        cfg, q = self.cfg, self.queues[task]
        while True:
            self.clock.park(lambda: q or (self.free_run and self._backlog() < cfg.max_backlog))
            if q:
                index, attempt = q.popleft()
            else:
                index, attempt = self.buffer.next_prompt(accept=lambda i: self.task_of(i) == task)
            version, t0 = self.version, self.clock.now
            jitter = random.Random(f"{cfg.seed}:gen:{index}:{attempt}").uniform(0.75, 1.25)
            self.clock.sleep(cfg.gen_s[task] * jitter)
            tokens = 2 * cfg.tokens[task]
            self.buffer.put(Group(index, TaskItem(index, f"p{index}", meta={"task": task}),
                                  [("sb", f"g{index}r{attempt}s{j}") for j in range(2)], [0.0, 1.0],
                                  versions={version: tokens}, tokens=tokens, requested_version=version,
                                  requested_at=t0, finished_at=self.clock.now, attempt=attempt))

    def _restart(self) -> None:
        self.free_run = True
        self.clock.sleep(self.cfg.outage_s)
        self.free_run = False
        self.restart_step = len(self.trained)
        self.restart_backlog = sorted(d["item"]["index"] for d in self.buffer.snapshot()["groups"])
        if self.cfg.after_restart == "naive":
            self.buffer.policy = BufferPolicy.oldest_first(self.cfg.max_lag)

    def _trainer(self) -> None:
        cfg = self.cfg
        while len(self.trained) < cfg.steps:
            if cfg.outage_s is not None and len(self.trained) == cfg.fail_after and self.restart_step is None:
                self._restart()
            seen = self.buffer.added
            try:
                groups = self.buffer.take(cfg.n, self.version, timeout_s=0)
            except TimeoutError:
                self.clock.park(lambda: self.buffer.added != seen or self.buffer.policy.patience_over())
                continue
            indices = [g.item.index for g in groups]
            self.buffer.consume(indices)
            self.lineage.extend(indices)
            self.trained.append([g.item.meta["task"] for g in groups])
            self.credit += cfg.n
            self.clock.sleep(cfg.step_s)
            self.version += 1

    def run(self, until_s: float = 10_000.0) -> "OutageSim":
        self.clock.spawn(self._dispatcher, "dispatcher")
        for task in self.cfg.mix:
            for k in range(self.cfg.workers):
                self.clock.spawn(lambda task=task, k=k: self._worker(task, k), f"engine-{task}{k}")
        done = threading.Event()
        self.clock.spawn(lambda: (self._trainer(), done.set()), "trainer")
        try:
            while not done.is_set() and self.clock.now < until_s:
                self.clock.run(self.clock.now + 10.0)
        finally:
            self.clock.stop()
        return self

    def mix(self, first: int, steps: int) -> dict:
        """``{task: groups}`` trained in steps ``first .. first + steps - 1`` (0-based)."""
        out = {t: 0 for t in self.cfg.mix}
        for tasks in self.trained[first:first + steps]:
            for t in tasks:
                out[t] += 1
        return out
