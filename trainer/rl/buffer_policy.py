"""The buffer policy: which finished groups a training step takes and which are dropped -- in steady state and
after the trainer was away while the rollout pipeline kept generating (the bias argument: ``docs/trainer.md``,
"The buffer after an outage").

While the trainer is down, the engines keep generating at their own throughput: a task (or a length) that is
4x faster to generate finishes 4x as many groups. Oldest-first over that backlog trains the mix that happened to
finish first, not the mix the prompt source generates. :class:`BufferPolicy` selects so that the trained mix is
the source's:

* **Strata.** A group's stratum is ``(task, length bucket)``: the task is ``item.meta["task"]`` (``""`` when the
  item names none: a run of one task is one task stratum), the length bucket ``floor(log2(mean generated tokens
  per sample))`` (``stratum=`` replaces the key).
* **Targets: the prompt source's own mix**, measured without being told. The prompt ledger's *frontier*
  (:meth:`syncd.trainer.rl.rl_state.PromptLedger.frontier`: the lowest prompt index still in flight or waiting to
  be requested) passes an index only once that prompt's group has landed, so the prompts below it form a sample of
  the source whose membership was fixed by the order prompts were dispatched in, not by how fast they finished.
  The strata of the last ``settled_window`` prompts the frontier passed give the target shares (additive smoothing
  ``0.5`` over the strata seen). ``targets={task: weight}`` fixes the task shares instead (lengths within a task
  are still measured). Before anything settled there is no target and selection is oldest-first.
* **Staleness bound eta** (``max_lag``): a group whose lag at the trainer's version exceeds eta is dropped
  (reason ``stale``).
* **A cap per version**: at most ``version_cap`` groups generated on one version (their oldest token's) are
  kept; the surplus is dropped at once (reason ``version_cap``), taken from the strata most over their target,
  newest first -- regenerated on fresh weights now rather than left to go stale. ``version_cap=None`` (default):
  ``(eta + 1) * G`` where ``G`` is the most groups taken at one trainer version (learnt from the takes seen;
  no cap before a version has been taken from): with a version published every ``k`` steps of ``n`` groups,
  exactly what the steps within the bound can train.
* **Quota, oldest-first within it**: groups are taken oldest-first (the buffer's arrival order) among the strata
  not over their share: stratum ``s`` may take one more while ``count_s + 1 <= share_s * W + slack``, counted
  over the last ``window`` groups taken with the candidate (``W`` of them; the window slides through this take's
  picks). When no candidate
  is eligible the take is short: the buffer waits for more groups (counted ``quota_waits``); once it has waited
  ``patience_s`` with enough groups present, it fills oldest-first regardless (``quota_overrides``), so a
  stratum whose producer died slows the trainer, never stops it.

With a single stratum (a run of one fixed-length task, as every shipped single-turn task is) all of this is
oldest-first within eta -- the behaviour before this policy -- but for the cap, which binds only on a backlog of
one version larger than the steps within eta can train (groups that would go stale untrained).
:meth:`BufferPolicy.oldest_first` is that naive policy for any mix. Every drop is counted by reason
(:attr:`BufferPolicy.dropped`, :meth:`stats`); the buffer sends each dropped prompt back to the ledger to be
regenerated.

:func:`chi2_sf` and :func:`mix_p_value` test a trained mix against a reference (chi-square homogeneity test;
the closed form of the regularised upper incomplete gamma function for integer degrees of freedom).

Not thread-safe: :class:`syncd.trainer.rl.buffer.RolloutBuffer` calls it under its lock.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import Counter, deque
from dataclasses import dataclass, field

__all__ = ["BufferPolicy", "Selection", "default_stratum", "chi2_sf", "mix_p_value"]

SMOOTHING = 0.5


def default_stratum(group) -> tuple[str, int]:
    """``(task, length bucket)`` of a group (module docstring)."""
    per_sample = group.tokens / max(1, len(group.trajectories))
    return str((group.item.meta or {}).get("task", "")), int(math.log2(per_sample)) if per_sample >= 1 else 0


@dataclass
class Selection:
    """What :meth:`BufferPolicy.select` decided: ``take`` (in the order taken), ``dropped`` (reason -> groups),
    ``keep`` (the rest, in buffer order), ``blocked`` (the take is short although enough groups are there: the
    quota held them back)."""

    take: list = field(default_factory=list)
    dropped: dict = field(default_factory=dict)
    keep: list = field(default_factory=list)
    blocked: bool = False


class BufferPolicy:
    """See the module docstring. ``max_lag``: eta; ``targets``: ``{task: weight}`` or None (measured);
    ``version_cap``: int, None (learnt) or 0 (off); ``window``: groups over which the trained mix is held to the
    targets; ``slack``: groups a stratum may run over its share; ``settled_window``: settled prompts the targets
    are measured over; ``patience_s``: how long a take waits on the quota before filling oldest-first;
    ``stratify``: False for oldest-first (no quota, no cap unless ``version_cap`` is given); ``clock``: seconds, for
    the patience (a simulation's clock in tests)."""

    def __init__(self, max_lag: int, *, targets: dict | None = None, version_cap: int | None = None,
                 window: int = 64, slack: float = 2.0, settled_window: int = 1024, patience_s: float = 5.0,
                 stratify: bool = True, stratum=default_stratum, clock=time.monotonic):
        if max_lag < 0:
            raise ValueError(f"the staleness bound must be >= 0, got {max_lag}")
        if version_cap is not None and version_cap < 0:
            raise ValueError(f"version_cap must be >= 0 (0: off), got {version_cap}")
        if targets is not None and (not targets or any(not w >= 0 for w in targets.values())
                                    or sum(targets.values()) <= 0):
            raise ValueError(f"targets must map tasks to weights >= 0, not all 0, got {targets}")
        if window < 1 or slack < 0 or settled_window < 1 or patience_s < 0:
            raise ValueError("window and settled_window must be >= 1, slack and patience_s >= 0")
        self.max_lag, self.targets, self.version_cap = max_lag, targets, version_cap
        self.slack, self.patience_s, self.stratify, self.stratum = slack, patience_s, stratify, stratum
        self.clock = clock
        self._blocked_since: float | None = None
        self._settled: deque = deque(maxlen=settled_window)
        self._settled_to = 0
        self._pending: dict[int, tuple] = {}
        self._heap: list[int] = []
        self._window: deque = deque(maxlen=window)
        self._taken_at: dict[int, int] = {}
        self.dropped: Counter = Counter()
        self.quota_waits = self.quota_overrides = 0

    @classmethod
    def oldest_first(cls, max_lag: int) -> "BufferPolicy":
        """The naive policy: oldest-first within eta, no strata, no cap."""
        return cls(max_lag, stratify=False, version_cap=0)

    # ------------------------------------------------------------------------------------ what it is told

    def is_stale(self, group, version: int) -> bool:
        return group.lag(version) > self.max_lag

    def observe(self, group) -> None:
        """A group of prompt ``group.item.index`` landed (idempotent)."""
        index = group.item.index
        if index not in self._pending:
            heapq.heappush(self._heap, index)
        self._pending[index] = tuple(self.stratum(group))

    def settle(self, frontier: int) -> None:
        """The ledger's frontier is ``frontier``: every landed prompt below it joins the target sample once."""
        while self._heap and self._heap[0] < frontier:
            index = heapq.heappop(self._heap)
            s = self._pending.pop(index, None)
            if s is not None and index >= self._settled_to:  # a regenerated prompt was counted the first time
                self._settled.append(s)
        self._settled_to = max(self._settled_to, frontier)

    def took(self, groups, version: int, *, forced: bool = False) -> None:
        """``groups`` were taken at trainer ``version``."""
        for g in groups:
            self._window.append(tuple(self.stratum(g)))
        self._taken_at[version] = self._taken_at.get(version, 0) + len(groups)
        for v in sorted(self._taken_at)[:-8]:
            del self._taken_at[v]
        self.quota_overrides += bool(forced)
        self._blocked_since = None

    def blocked(self) -> None:
        """A take is held back by the quota (counted once per wait; the patience runs from the first)."""
        if self._blocked_since is None:
            self._blocked_since = self.clock()
            self.quota_waits += 1

    def patience_over(self) -> bool:
        """A take has waited on the quota for ``patience_s`` (by ``clock``): the next one fills oldest-first."""
        return self._blocked_since is not None and self.clock() - self._blocked_since >= self.patience_s

    def count_drops(self, dropped: dict) -> None:
        for reason, groups in dropped.items():
            self.dropped[reason] += len(groups)

    # ------------------------------------------------------------------------------------ targets

    def shares(self, candidates=()) -> dict | None:
        """``{stratum: target share}`` over the strata settled or among ``candidates``; None: no target yet."""
        if not self.stratify:
            return None
        seen = Counter(self._settled)
        strata = set(seen) | {tuple(self.stratum(g)) for g in candidates}
        if self.targets is None:
            if not seen:
                return None
            total = sum(seen.values()) + SMOOTHING * len(strata)
            return {s: (seen[s] + SMOOTHING) / total for s in strata}
        weight = sum(self.targets.values())
        out = {}
        for task in {s[0] for s in strata} | set(self.targets):
            mine = [s for s in strata if s[0] == task] or [(task, 0)]
            n = sum(seen[s] for s in mine) + SMOOTHING * len(mine)
            for s in mine:
                out[s] = self.targets.get(task, 0.0) / weight * (seen[s] + SMOOTHING) / n
        return out

    def cap(self, version: int) -> int | None:
        if self.version_cap is not None:
            return self.version_cap or None
        done = [n for v, n in self._taken_at.items() if v < version]
        return (self.max_lag + 1) * max(done) if done else None

    # ------------------------------------------------------------------------------------ selection

    def admit(self, groups: list, version: int) -> Selection:
        """What may stay: drops the stale and the surplus over the cap per version (``keep``: the rest, in order)."""
        sel = Selection()
        fresh = []
        for g in groups:
            (sel.dropped.setdefault("stale", []) if self.is_stale(g, version) else fresh).append(g)
        cap = self.cap(version)
        if cap is not None:
            by_version: dict[int, list] = {}
            for g in fresh:
                by_version.setdefault(g.oldest_version, []).append(g)
            shares = self.shares(fresh)
            out = set()
            for gs in by_version.values():
                out |= {id(g) for g in self._surplus(gs, len(gs) - cap, shares)}
            sel.dropped["version_cap"] = [g for g in fresh if id(g) in out]
            fresh = [g for g in fresh if id(g) not in out]
        sel.dropped = {k: v for k, v in sel.dropped.items() if v}
        sel.keep = fresh
        return sel

    def _surplus(self, groups: list, k: int, shares: dict | None) -> list:
        """The ``k`` groups to drop from ``groups`` (one version's): from the stratum most over its share, newest
        first (oldest-first training keeps the oldest)."""
        if k <= 0:
            return []
        if shares is None:
            return groups[-k:]
        by: dict[tuple, list] = {}
        for g in groups:
            by.setdefault(tuple(self.stratum(g)), []).append(g)
        out, total = [], len(groups)
        for _ in range(k):
            s = max((s for s in by if by[s]), key=lambda s: len(by[s]) - shares.get(s, 0.0) * total)
            out.append(by[s].pop())
            total -= 1
        return out

    def select(self, groups: list, n: int, version: int, *, force: bool = False) -> Selection:
        """Take ``n`` of ``groups`` (the buffer's, in arrival order) at trainer ``version``: :meth:`admit`, then
        the quota (module docstring); ``force`` fills oldest-first past the quota. ``take`` may be short."""
        sel = self.admit(groups, version)
        pool = sel.keep
        shares = None if force else self.shares(pool)
        if shares is None:
            sel.take = pool[:n]
        else:
            win = deque(self._window, maxlen=self._window.maxlen)
            counts = Counter(win)
            by: dict[tuple, deque] = {}
            for g in pool:
                by.setdefault(tuple(self.stratum(g)), deque()).append(g)
            order = {id(g): i for i, g in enumerate(pool)}
            while len(sel.take) < n:
                if len(win) == win.maxlen:  # the window slides: its oldest pick leaves as this one comes in
                    counts[win[0]] -= 1
                w = min(len(win) + 1, win.maxlen)
                ok = [s for s, q in by.items() if q and counts[s] + 1 <= shares.get(s, 0.0) * w + self.slack]
                if len(win) == win.maxlen:
                    counts[win[0]] += 1
                if not ok:
                    sel.blocked = len(pool) >= n
                    break
                s = min(ok, key=lambda s: order[id(by[s][0])])
                sel.take.append(by[s].popleft())
                if len(win) == win.maxlen:
                    counts[win[0]] -= 1
                win.append(s)
                counts[s] += 1
        taken = {id(g) for g in sel.take}
        sel.keep = [g for g in pool if id(g) not in taken]
        return sel

    # ------------------------------------------------------------------------------------ reporting, state

    def stats(self) -> dict:
        """JSON-able: drops by reason, quota waits and overrides, the target shares and the mix of the window."""
        name = _name
        shares = self.shares() or {}
        window = Counter(self._window)
        return {"dropped": dict(self.dropped), "quota_waits": self.quota_waits,
                "quota_overrides": self.quota_overrides, "settled": len(self._settled),
                "targets": {name(s): round(v, 4) for s, v in sorted(shares.items())},
                "window_mix": {name(s): c for s, c in sorted(window.items())}}

    def state_dict(self) -> dict:
        """What a checkpoint keeps (JSON-able): the settled sample, the window, takes per version, the counters."""
        return {"settled": [list(s) for s in self._settled], "settled_to": self._settled_to,
                "pending": {str(i): list(s) for i, s in sorted(self._pending.items())},
                "window": [list(s) for s in self._window],
                "taken_at": {str(v): n for v, n in sorted(self._taken_at.items())},
                "dropped": dict(self.dropped), "quota_waits": self.quota_waits,
                "quota_overrides": self.quota_overrides}

    def load_state_dict(self, doc: dict | None) -> None:
        """Put back :meth:`state_dict` (None or {}: nothing learnt yet); ValueError when malformed."""
        if not doc:
            return
        try:
            self._settled.clear()
            self._settled.extend(tuple(s) for s in doc["settled"])
            self._settled_to = int(doc["settled_to"])
            self._pending = {int(i): tuple(s) for i, s in doc["pending"].items()}
            self._heap = sorted(self._pending)
            self._window.clear()
            self._window.extend(tuple(s) for s in doc["window"])
            self._taken_at = {int(v): int(n) for v, n in doc["taken_at"].items()}
            self.dropped = Counter({str(k): int(v) for k, v in doc["dropped"].items()})
            self.quota_waits, self.quota_overrides = int(doc["quota_waits"]), int(doc["quota_overrides"])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"not a buffer policy state: {type(exc).__name__}: {exc}") from None


def _name(s: tuple) -> str:
    return f"{s[0] or '-'}:len{2 ** s[1]}+"


# ---------------------------------------------------------------------------------------- the mix test

def chi2_sf(x: float, dof: int) -> float:
    """``P(X >= x)`` for ``X`` chi-square with ``dof`` (a positive integer) degrees of freedom: the regularised
    upper incomplete gamma function ``Q(dof/2, x/2)`` in closed form (a finite sum; ``erfc`` for odd ``dof``)."""
    if not isinstance(dof, int) or dof < 1:
        raise ValueError(f"dof must be a positive integer, got {dof!r}")
    if x <= 0:
        return 1.0
    h = x / 2.0
    if dof % 2 == 0:
        term = total = 1.0
        for i in range(1, dof // 2):
            term *= h / i
            total += term
        return min(1.0, math.exp(-h) * total)
    total = math.erfc(math.sqrt(h))
    term = math.sqrt(h) / math.gamma(1.5)  # h^(j-1/2) / Gamma(j+1/2), j = 1
    for j in range(1, (dof + 1) // 2):
        total += math.exp(-h) * term
        term *= h / (j + 0.5)
    return min(1.0, total)


def mix_p_value(a: dict, b: dict) -> tuple[float, float, int]:
    """The chi-square test of homogeneity of two mixes (``{category: count}``): ``(p, statistic, dof)``. A
    category neither has is left out; p is 1.0 with fewer than two categories."""
    cats = sorted({k for k in (*a, *b) if a.get(k, 0) + b.get(k, 0) > 0}, key=str)
    na, nb = sum(a.get(k, 0) for k in cats), sum(b.get(k, 0) for k in cats)
    if len(cats) < 2 or na == 0 or nb == 0:
        return 1.0, 0.0, 0
    stat = 0.0
    for k in cats:
        col = a.get(k, 0) + b.get(k, 0)
        for n, obs in ((na, a.get(k, 0)), (nb, b.get(k, 0))):
            exp = n * col / (na + nb)
            stat += (obs - exp) ** 2 / exp
    dof = len(cats) - 1
    return chi2_sf(stat, dof), stat, dof
