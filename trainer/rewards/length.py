"""The SWE-1.7 alternating length penalty, and zero reward for cheating attempts.

Alternating schedule: training steps cycle through segments of **unconstrained** phases (the reward is
the task reward alone) and **budget** phases (solutions whose weighted cost exceeds a budget are
penalized). The weighted cost of a trajectory is

    cost = per_token·tokens + per_turn·turns + per_tool_second·tool_time_s

in whatever unit the weights give it (e.g. "token equivalents" with per_token = 1).

Budget-phase penalty. With ``overrun = max(0, cost - budget) / budget`` (relative excess, ≥ 0):

    penalty = max_penalty · min(1, overrun / saturate_at)        ∈ [0, max_penalty] ⊂ [0, 1]
    reward  = base_reward · (1 - penalty)

The penalty is *multiplicative* on a base reward ≥ 0: it scales down what a solution earned rather than
subtracting a constant. A subtractive penalty would also hit failed trajectories, making a quick give-up
score above a long failed attempt on a hard task; scaling keeps every over-budget success ≥ any failure
(strictly above it when ``max_penalty < 1``), which is what the seed reports: "response length tends to
compress on tasks within the model's ability, while long-horizon behavior on hard tasks is preserved".

Cheating: any trajectory flagged as a cheating attempt gets reward 0, whether or not the attempt succeeded
and whatever else it earned (:func:`zero_if_cheating`). With base rewards ≥ 0 (as required here) 0 is the
lowest reward, so cheating never pays.
"""

from __future__ import annotations

import enum
import numbers
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from . import _validate as v

__all__ = ["LengthPhase", "CostWeights", "AlternatingLengthPenalty", "zero_if_cheating"]


class LengthPhase(enum.Enum):
    """A phase of the alternating length penalty."""

    UNCONSTRAINED = "unconstrained"
    BUDGET = "budget"


@dataclass(frozen=True)
class CostWeights:
    """Weights of the trajectory cost ``per_token·tokens + per_turn·turns + per_tool_second·tool_time_s``.

    All weights are finite and ≥ 0, and at least one is > 0 (raises ValueError otherwise).
    """

    per_token: float = 1.0
    per_turn: float = 0.0
    per_tool_second: float = 0.0

    def __post_init__(self) -> None:
        for name in ("per_token", "per_turn", "per_tool_second"):
            object.__setattr__(self, name, v.nonneg(name, getattr(self, name)))
        if self.per_token == self.per_turn == self.per_tool_second == 0.0:
            raise v.RewardInputError("cost weights are all 0; at least one of tokens, turns, tool time must count")

    def cost(self, tokens: object, turns: object, tool_time_s: object) -> float | np.ndarray:
        """Weighted cost (≥ 0) of trajectories; scalars or broadcastable arrays of values ≥ 0."""
        tok = v.nonneg_array("tokens", tokens)
        trn = v.nonneg_array("turns", turns)
        tts = v.nonneg_array("tool_time_s", tool_time_s)
        try:
            out = self.per_token * tok + self.per_turn * trn + self.per_tool_second * tts
        except ValueError as exc:
            raise v.RewardInputError(
                f"tokens {tok.shape}, turns {trn.shape} and tool_time_s {tts.shape} shapes do not broadcast"
            ) from exc
        return v.scalar_or_array(out)


def _bool_array(name: str, x: object) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype != np.bool_:
        raise TypeError(f"{name} must be a bool or an array of bools, got dtype {a.dtype}")
    return a


def zero_if_cheating(reward: object, cheated: object) -> float | np.ndarray:
    """``reward`` with every entry flagged by ``cheated`` replaced by 0.

    Args:
        reward: rewards (finite), scalar or array.
        cheated: bool or bool array broadcastable to ``reward``; True for any cheating *attempt*,
            successful or not.

    Raises:
        ValueError (:class:`RewardInputError`): NaN/inf rewards or shapes that do not broadcast.
        TypeError: ``cheated`` is not boolean (so that e.g. a 0/1 float array is not silently accepted).
    """
    r = v.float_array("reward", reward)
    c = _bool_array("cheated", cheated)
    try:
        out = np.where(c, 0.0, r)
    except ValueError as exc:
        raise v.RewardInputError(f"reward shape {r.shape} and cheated shape {c.shape} do not broadcast") from exc
    return v.scalar_or_array(out)


@dataclass(frozen=True)
class AlternatingLengthPenalty:
    """Alternating length penalty on a cyclic schedule of phases (see the module doc for the formulas).

    Attributes:
        segments: ``((phase, n_steps), ...)`` repeated forever from step 0, each n_steps ≥ 1; e.g.
            ``((UNCONSTRAINED, 50), (BUDGET, 20))``. :meth:`periodic` builds the two-segment case.
        budget: cost budget (> 0) in the units of ``weights``.
        weights: the :class:`CostWeights` of tokens, turns and tool time.
        max_penalty: fraction of the reward removed at full overrun, in [0, 1].
        saturate_at: relative overrun (> 0) at which the penalty reaches max_penalty; 1.0 means at twice
            the budget.

    Raises (on construction):
        ValueError (:class:`RewardInputError`): empty schedule, a segment shorter than 1 step, a bad
            budget/max_penalty/saturate_at. TypeError: a segment is not (LengthPhase, int).
    """

    segments: tuple[tuple[LengthPhase, int], ...]
    budget: float
    weights: CostWeights
    max_penalty: float = 0.5
    saturate_at: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.segments, Iterable):
            raise TypeError(
                f"segments must be a sequence of (LengthPhase, n_steps), got {type(self.segments).__name__}"
            )
        segs = tuple(self.segments)
        if not segs:
            raise v.RewardInputError("segments is empty; the schedule needs at least one (phase, n_steps)")
        checked = []
        for i, seg in enumerate(segs):
            if not (isinstance(seg, tuple) and len(seg) == 2 and isinstance(seg[0], LengthPhase)):
                raise TypeError(f"segments[{i}] must be a (LengthPhase, n_steps) tuple, got {seg!r}")
            n = seg[1]
            if isinstance(n, bool) or not isinstance(n, numbers.Integral):
                raise TypeError(f"segments[{i}] n_steps must be an integer, got {n!r}")
            if n < 1:
                raise v.RewardInputError(f"segments[{i}] must last at least 1 step, got {n}")
            checked.append((seg[0], int(n)))
        object.__setattr__(self, "segments", tuple(checked))
        object.__setattr__(self, "budget", v.positive("budget", self.budget))
        if not isinstance(self.weights, CostWeights):
            raise TypeError(f"weights must be CostWeights, got {type(self.weights).__name__}")
        object.__setattr__(self, "max_penalty", v.unit("max_penalty", self.max_penalty))
        object.__setattr__(self, "saturate_at", v.positive("saturate_at", self.saturate_at))

    @classmethod
    def periodic(
        cls,
        unconstrained_steps: int,
        budget_steps: int,
        *,
        budget: float,
        weights: CostWeights,
        start: LengthPhase = LengthPhase.UNCONSTRAINED,
        max_penalty: float = 0.5,
        saturate_at: float = 1.0,
    ) -> AlternatingLengthPenalty:
        """``unconstrained_steps`` unconstrained steps and ``budget_steps`` budget steps, alternating,
        starting with ``start``."""
        u = (LengthPhase.UNCONSTRAINED, unconstrained_steps)
        b = (LengthPhase.BUDGET, budget_steps)
        segs = (u, b) if start is LengthPhase.UNCONSTRAINED else (b, u)
        return cls(segs, budget, weights, max_penalty=max_penalty, saturate_at=saturate_at)

    @property
    def cycle_steps(self) -> int:
        """Length of one full cycle of the schedule, in steps."""
        return sum(n for _, n in self.segments)

    def phase(self, step: int) -> LengthPhase:
        """The phase of training step ``step`` (integer ≥ 0)."""
        s = v.step("step", step) % self.cycle_steps
        for ph, n in self.segments:
            if s < n:
                return ph
            s -= n
        raise AssertionError("unreachable: step modulo cycle length lies in some segment")

    def penalty(self, tokens: object, turns: object, tool_time_s: object) -> float | np.ndarray:
        """Penalty fraction in [0, max_penalty]: 0 within budget, growing linearly with the relative
        overrun, capped at max_penalty from ``overrun = saturate_at`` on."""
        cost = np.asarray(self.weights.cost(tokens, turns, tool_time_s))
        overrun = np.maximum(cost - self.budget, 0.0) / self.budget
        return v.scalar_or_array(self.max_penalty * np.minimum(overrun / self.saturate_at, 1.0))

    def reward(
        self,
        step: int,
        base_reward: object,
        *,
        tokens: object,
        turns: object,
        tool_time_s: object,
        cheated: object = False,
    ) -> float | np.ndarray:
        """The final reward at training step ``step``, scalars or broadcastable arrays.

        0 where ``cheated``; otherwise ``base_reward`` in unconstrained phases and
        ``base_reward·(1 - penalty)`` in budget phases. Always in [0, base_reward].

        Raises:
            ValueError (:class:`RewardInputError`): a negative/NaN/inf base reward (the multiplicative
                penalty needs rewards ≥ 0), bad counts, or shapes that do not broadcast.
            TypeError: ``cheated`` is not boolean.
        """
        base = v.nonneg_array("base_reward", base_reward)
        pen = np.asarray(self.penalty(tokens, turns, tool_time_s))  # validates counts in both phases
        if self.phase(step) is LengthPhase.UNCONSTRAINED:
            pen = np.zeros_like(pen)
        try:
            out = base * (1.0 - pen)
        except ValueError as exc:
            raise v.RewardInputError(
                f"base_reward shape {base.shape} and count shape {pen.shape} do not broadcast"
            ) from exc
        return zero_if_cheating(out, cheated)
