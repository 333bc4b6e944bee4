"""Task curation: per-task pass-rate estimates and a difficulty filter on the loop's task sampler.

The seed trains on "data that the model only solves a low fraction of the time": a task the policy always
solves, or never solves, gives a group of equal rewards, zero advantages and no gradient. :class:`Curator`
keeps, per task id, the outcomes of its recent attempts (a sample is *solved* when its reward is at least
``solved_at``) and a Beta posterior of its pass rate, ``Beta(a0 + solved, b0 + failed)`` over the last
``window`` attempts (so the estimate follows the policy as it improves). A task is

* ``too_easy`` when the posterior puts at least ``confidence`` of its mass above the band's top
  (``P(p > high) >= confidence``: always-solved tasks end here after a few attempts),
* ``too_hard`` when it puts at least ``confidence`` below the band's bottom (never-solved tasks),
* kept otherwise -- an unseen or uncertain task is kept, so it gets attempts that decide it.

:class:`CuratedTask` applies the filter to the loop's task sampler: it wraps a :class:`syncd.trainer.rl.tasks.Task`
over a finite pool of its items (``pool`` item indices). Draw ``index`` maps to an item as a pure function of
the index and the current estimates (:meth:`CuratedTask.item`), so the rollout workers' per-index seeds stay
reproducible whatever thread draws. The rollout workers record a group's rewards (:meth:`CuratedTask.observe`)
once the group is in the rollout buffer, so a group dropped on the way never moves an estimate. A dropped task
is not lost for good: after ``recheck_after`` of its turns were skipped it is let through once, so a task that
was too hard is re-estimated once the policy improved (0: never; a pool with nothing kept is then an error).
Counts of what was skipped and why, and the current verdict of every task, are in :meth:`CuratedTask.stats`;
:meth:`CuratedTask.state_dict`/``load_state_dict`` checkpoint the whole filter.

Beta tail probabilities come from ``mpmath.betainc`` (declared in the ``trainer`` extra; scipy is not a
dependency of the project). Thread-safety: :class:`Curator` and :class:`CuratedTask` take a lock; the rollout
workers call them from several threads.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from dataclasses import dataclass

from syncd.trainer.rl.tasks import Sample, Task, TaskItem

__all__ = ["CurationConfig", "Curator", "CuratedTask", "Estimate", "CurationExhausted", "KEPT", "TOO_EASY",
           "TOO_HARD", "beta_tail"]

KEPT, TOO_EASY, TOO_HARD = "kept", "too_easy", "too_hard"


class CurationExhausted(RuntimeError):
    """Every task of the pool is outside the band and ``recheck_after`` is 0: no draw can ever succeed again.
    ``fatal``: the rollout workers stop and close the buffer on it rather than retry."""

    fatal = True


@dataclass(frozen=True)
class CurationConfig:
    """``band``: the solve rates kept, ``0 <= low < high <= 1``; ``solved_at``: the reward that counts as a solve;
    ``prior``: ``(a0, b0)`` of the Beta prior (> 0); ``confidence``: the posterior mass outside the band that
    drops a task, in (0.5, 1); ``window``: attempts per task the estimate uses (the most recent); ``pool``: item
    indices of the wrapped task (``range(pool)``); ``recheck_after``: skipped turns before a dropped task gets
    another attempt (0: never). Raises ValueError naming the field."""

    band: tuple[float, float] = (0.05, 0.5)
    solved_at: float = 1.0
    prior: tuple[float, float] = (1.0, 1.0)
    confidence: float = 0.9
    window: int = 64
    pool: int = 64
    recheck_after: int = 32

    def __post_init__(self):
        low, high = self.band
        if not 0.0 <= low < high <= 1.0:
            raise ValueError(f"curation band must be 0 <= low < high <= 1, got {self.band}")
        if not (self.prior[0] > 0 and self.prior[1] > 0):
            raise ValueError(f"curation prior (a0, b0) must be > 0, got {self.prior}")
        if not 0.5 < self.confidence < 1.0:
            raise ValueError(f"curation confidence must be in (0.5, 1), got {self.confidence}")
        if self.window < 1 or self.pool < 1 or self.recheck_after < 0:
            raise ValueError(f"curation window and pool must be >= 1 and recheck_after >= 0, got {self.window}, "
                             f"{self.pool}, {self.recheck_after}")


def beta_tail(x: float, a: float, b: float) -> float:
    """``P(p <= x)`` for ``p ~ Beta(a, b)`` (the regularized incomplete beta function)."""
    import mpmath

    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    return float(mpmath.betainc(a, b, 0, x, regularized=True))


@dataclass(frozen=True)
class Estimate:
    """A task's posterior: ``solved``/``attempts`` in the window, ``mean`` of ``Beta(a, b)``, the posterior mass
    below and above the band, and the verdict (:data:`KEPT`, :data:`TOO_EASY`, :data:`TOO_HARD`)."""

    task_id: object
    attempts: int
    solved: int
    a: float
    b: float
    below: float
    above: float
    verdict: str

    @property
    def mean(self) -> float:
        return self.a / (self.a + self.b)


class Curator:
    """Pass-rate estimates and verdicts per task id (see the module docstring)."""

    def __init__(self, config: CurationConfig = CurationConfig()):
        self.config = config
        self._outcomes: dict[object, deque] = {}
        self._cache: dict[object, Estimate] = {}
        self._lock = threading.Lock()

    def observe(self, task_id, rewards) -> None:
        """Record the rewards of attempts at ``task_id`` (each solved when ``>= solved_at``)."""
        with self._lock:
            q = self._outcomes.setdefault(task_id, deque(maxlen=self.config.window))
            q.extend(float(r) >= self.config.solved_at for r in rewards)
            self._cache.pop(task_id, None)

    def state_dict(self) -> dict:
        """``{"outcomes": [[task_id, [solved: bool, ...]], ...]}`` (oldest first; JSON-able for JSON task ids)."""
        with self._lock:
            return {"outcomes": [[t, list(q)] for t, q in self._outcomes.items()]}

    def load_state_dict(self, state: dict) -> None:
        """Replace the outcomes with :meth:`state_dict`'s (the newest ``window`` of each task kept). Raises
        ValueError when ``state`` is malformed; nothing changes then."""
        rows = state.get("outcomes") if isinstance(state, dict) else None
        if not isinstance(rows, list) or not all(
                isinstance(r, (list, tuple)) and len(r) == 2 and isinstance(r[1], list)
                and all(isinstance(o, bool) for o in r[1]) for r in rows):
            raise ValueError("curator state: want {'outcomes': [[task_id, [bool, ...]], ...]}")
        outcomes = {}
        for t, q in rows:
            try:
                outcomes[t] = deque(q, maxlen=self.config.window)
            except TypeError:
                raise ValueError(f"curator state: task id {t!r} is not hashable") from None
        with self._lock:
            self._outcomes, self._cache = outcomes, {}

    def estimate(self, task_id) -> Estimate:
        with self._lock:
            return self._estimate(task_id)

    def _estimate(self, task_id) -> Estimate:
        est = self._cache.get(task_id)
        if est is not None:
            return est
        q = self._outcomes.get(task_id, ())
        n, s = len(q), sum(q)
        a, b = self.config.prior[0] + s, self.config.prior[1] + n - s
        low, high = self.config.band
        below, above = beta_tail(low, a, b), 1.0 - beta_tail(high, a, b)
        verdict = TOO_HARD if below >= self.config.confidence else TOO_EASY if above >= self.config.confidence \
            else KEPT
        est = self._cache[task_id] = Estimate(task_id, n, s, a, b, below, above, verdict)
        return est

    def verdict(self, task_id) -> str:
        return self.estimate(task_id).verdict

    def estimates(self) -> list[Estimate]:
        with self._lock:
            return [self._estimate(t) for t in list(self._outcomes)]


class CuratedTask(Task):
    """``task`` over a pool of its items, filtered by a :class:`Curator` (see the module docstring). The rollout
    workers call :meth:`item` with consecutive indices and :meth:`observe` with each group that reached the
    buffer."""

    def __init__(self, task: Task, config: CurationConfig = CurationConfig()):
        super().__init__(task.length)
        self.task, self.config = task, config
        self.name = f"{task.name}+curated"
        self.ignore_eos = task.ignore_eos
        self.curator = Curator(config)
        self.skipped: Counter = Counter()  # draws a task was passed over, by verdict
        self.rechecks = 0
        self.draws = 0
        self._lock = threading.Lock()

    @property
    def max_tokens(self) -> int:
        return self.task.max_tokens

    def max_tokens_for(self, item: TaskItem) -> int:
        return self.task.max_tokens_for(item)

    def item(self, index: int, seed: int = 0) -> TaskItem:
        """The item of draw ``index``: a pure function of ``index`` and the curator's estimates, so a draw gets the
        same task whichever rollout thread asks for it and whenever (the workers' per-index seeds stay
        reproducible). Draw ``index`` belongs to pool item ``home = index % pool`` (its turn number is
        ``index // pool``): a kept ``home`` is drawn; a dropped one is drawn once every ``recheck_after + 1`` of
        its turns (a recheck), otherwise the draw goes to kept item ``kept[index % len(kept)]``. When no item is
        kept, every draw is its ``home``'s recheck -- or, with ``recheck_after == 0``, :class:`CurationExhausted`
        is raised (no estimate can change any more: the run cannot go on)."""
        pool, every = self.config.pool, self.config.recheck_after + 1
        if index < 0:
            raise ValueError(f"draw index must be >= 0, got {index}")
        home, turn = index % pool, index // pool
        with self._lock:
            verdicts = [self.curator.verdict(k) for k in range(pool)]
            k = home
            if verdicts[home] != KEPT:
                kept = [j for j, v in enumerate(verdicts) if v == KEPT]
                if self.config.recheck_after and (turn % every == every - 1 or not kept):
                    self.rechecks += 1
                elif kept:
                    self.skipped[verdicts[home]] += 1
                    k = kept[index % len(kept)]
                else:
                    raise CurationExhausted(
                        f"curation.band {self.config.band}: all {pool} tasks of {self.task.name} are outside the "
                        f"solve-rate band and curation.recheck_after is 0, so none is ever tried again: "
                        f"{dict(Counter(verdicts))}; widen the band or set recheck_after > 0")
            self.draws += 1
        base = self.task.item(k, seed)
        return TaskItem(base.index, base.prompt, base.target, {**base.meta, "curation": {"task_id": k}})

    def observe(self, item: TaskItem, rewards) -> None:
        """Record the rewards of a group of attempts at ``item``. The rollout workers call it once the group is in
        the rollout buffer, so groups dropped on the way (a missing record, a timeout) never move an estimate."""
        self.curator.observe(item.meta["curation"]["task_id"], rewards)

    def state_dict(self) -> dict:
        """The filter's state, JSON-able: the curator's outcomes and the draw counters (the draw itself depends on
        nothing else). Restore it with :meth:`load_state_dict` on a task built with the same configuration."""
        with self._lock:
            return {"config": {"pool": self.config.pool, "window": self.config.window},
                    "curator": self.curator.state_dict(), "skipped": dict(self.skipped), "rechecks": self.rechecks,
                    "draws": self.draws}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`. Raises ValueError when ``state`` is malformed or its pool differs."""
        if not isinstance(state, dict) or not isinstance(state.get("config"), dict):
            raise ValueError("curation state: not a CuratedTask.state_dict()")
        if state["config"].get("pool") != self.config.pool:
            raise ValueError(f"curation state: pool {state['config'].get('pool')!r} != configured "
                             f"{self.config.pool}")
        counters = [state.get("rechecks"), state.get("draws"), *(state.get("skipped") or {}).values()]
        if not isinstance(state.get("skipped"), dict) \
                or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counters):
            raise ValueError("curation state: skipped/rechecks/draws must be counts >= 0")
        self.curator.load_state_dict(state.get("curator"))
        with self._lock:
            self.skipped = Counter(state["skipped"])
            self.rechecks, self.draws = state["rechecks"], state["draws"]

    def reward(self, sample: Sample) -> float:
        return self.task.reward(sample)

    def _verdicts(self) -> dict:
        return dict(Counter(self.curator.verdict(k) for k in range(self.config.pool)))

    def stats(self) -> dict:
        """``{"pool", "verdicts": {kept, too_easy, too_hard: tasks}, "skipped": {verdict: draws}, "rechecks",
        "draws"}``: what the filter keeps now, what it passed over and why."""
        with self._lock:
            return {"pool": self.config.pool, "verdicts": self._verdicts(), "skipped": dict(self.skipped),
                    "rechecks": self.rechecks, "draws": self.draws}

    def describe(self) -> dict:
        return {**self.task.describe(), "curation": self.stats()}
