"""The SWE-check two-phase post-training reward: capability first, then product (latency) alignment.

The two phases differ only in the reward (the rest of the training setup is identical):

* **capability** (steps ``< product_start_step``, most of the training compute): the base reward, e.g. the
  linearized F_β reward of :class:`syncd.trainer.rewards.LinearizedReward`; latency is not penalized.
* **product** (steps ``>= product_start_step``, a much shorter phase): the base reward minus
  ``latency_weight`` times the latency penalty of :mod:`syncd.trainer.rewards.latency`, which lies in [0, 1]:

      reward = base_reward - latency_weight · penalty(latency_model.estimate(tokens, turns)).

The seed found this split beats one combined reward from the start (which converged to fast but shallow
analyses). The phase-2 checkpoint and ``latency_weight`` are the knob that picks a point on the
performance/latency Pareto frontier.

Range: the product-phase reward lies in ``[base_reward - latency_weight, base_reward]`` and can be
negative. Combined with :func:`syncd.trainer.rewards.zero_if_cheating`, a flagged rollout (reward 0) would then
score above a slow honest failure (as low as ``-latency_weight``); if that matters, add ``latency_weight``
to every honest reward (a constant shift, invisible to a mean baseline) so honest rewards stay ≥ 0.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from . import _validate as v
from .latency import LatencyModel, SwitchAwayCDF

__all__ = ["Phase", "TwoPhaseReward"]


class Phase(enum.Enum):
    """A phase of SWE-check post-training."""

    CAPABILITY = "capability"
    PRODUCT = "product"


@dataclass(frozen=True, eq=False)
class TwoPhaseReward:
    """Capability-then-product reward schedule.

    Attributes:
        product_start_step: first training step (0-based) of the product phase; 0 means no capability phase.
        latency_weight: weight λ ≥ 0 of the latency penalty in the product phase (reward units per unit of
            penalty; the penalty itself is in [0, 1]).
        latency_model: estimates a rollout's latency in seconds from completion tokens and tool turns.
        switch_away: the penalty curve built from users' switch-away times.

    Raises (on construction):
        ValueError (:class:`RewardInputError`): negative step or weight, NaN/inf weight.
        TypeError: wrong types for the step, model or curve.
    """

    product_start_step: int
    latency_weight: float
    latency_model: LatencyModel
    switch_away: SwitchAwayCDF

    def __post_init__(self) -> None:
        object.__setattr__(self, "product_start_step", v.step("product_start_step", self.product_start_step))
        object.__setattr__(self, "latency_weight", v.nonneg("latency_weight", self.latency_weight))
        if not isinstance(self.latency_model, LatencyModel):
            raise TypeError(f"latency_model must be a LatencyModel, got {type(self.latency_model).__name__}")
        if not isinstance(self.switch_away, SwitchAwayCDF):
            raise TypeError(f"switch_away must be a SwitchAwayCDF, got {type(self.switch_away).__name__}")

    def phase(self, step: int) -> Phase:
        """The phase of training step ``step`` (an integer ≥ 0)."""
        return Phase.PRODUCT if v.step("step", step) >= self.product_start_step else Phase.CAPABILITY

    def penalty(self, completion_tokens: object, tool_turns: object) -> float | np.ndarray:
        """Latency penalty in [0, 1] of rollouts with these completion-token and tool-turn counts."""
        return self.switch_away(self.latency_model.estimate(completion_tokens, tool_turns))

    def reward(
        self, step: int, base_reward: object, *, completion_tokens: object, tool_turns: object
    ) -> float | np.ndarray:
        """The reward at training step ``step``: base reward, minus the weighted latency penalty in the
        product phase. Scalars or broadcastable arrays (one entry per rollout).

        Raises ValueError on NaN/inf base rewards, negative/NaN counts, or shapes that do not broadcast.
        """
        base = v.float_array("base_reward", base_reward)
        if self.phase(step) is Phase.CAPABILITY:
            # Still validate the counts, so a bad rollout record fails in both phases alike.
            self.latency_model.estimate(completion_tokens, tool_turns)
            return v.scalar_or_array(base)
        pen = np.asarray(self.penalty(completion_tokens, tool_turns))
        try:
            out = base - self.latency_weight * pen
        except ValueError as exc:
            raise v.RewardInputError(
                f"base_reward shape {base.shape} and rollout count shape {pen.shape} do not broadcast"
            ) from exc
        return v.scalar_or_array(out)
