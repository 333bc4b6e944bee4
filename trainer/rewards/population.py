"""Population metrics over many scored rollouts.

The SWE-check seed names two ways to aggregate per-sample scores and trains on the second:

* **averaged** (the training target): ``P_pop = E_τ[P(τ)]``, ``R_pop = E_τ[R(τ)]``, then
  ``F_β(P_pop, R_pop)``. Every rollout weighs the same, whether it has zero or ten ground-truth bugs.
* **pooled** (for comparison): global TP, FP, FN summed over rollouts, global precision and recall, then
  F_β. Rollouts with many ground-truth bugs dominate, and rollouts with neither predictions nor bugs do
  not count at all, which is why the seed did not train on it.

Note that ``E_τ[F_β(P(τ), R(τ))]`` is neither of these; averaging per-sample F_β does not give F_β of the
averages, which is what motivates the linearized reward of :mod:`syncd.trainer.rewards.linearize`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from . import _validate as v
from .fbeta import fbeta, pr_from_counts
from .matching import SampleScore

__all__ = ["PopulationMetrics", "population_metrics"]


@dataclass(frozen=True)
class PopulationMetrics:
    """Aggregates of ``n`` scored rollouts at a given β.

    Attributes:
        n: number of rollouts.
        beta: the F_β weight used.
        p_pop, r_pop: mean sample precision and recall, in [0, 1].
        fbeta_pop: F_β(p_pop, r_pop), the metric the linearized reward climbs.
        tp, fp, fn: pooled counts.
        p_global, r_global: precision and recall of the pooled counts
            (see :func:`syncd.trainer.rewards.pr_from_counts` for the edge cases).
        fbeta_global: F_β(p_global, r_global).
    """

    n: int
    beta: float
    p_pop: float
    r_pop: float
    fbeta_pop: float
    tp: int
    fp: int
    fn: int
    p_global: float
    r_global: float
    fbeta_global: float


def population_metrics(scores: Iterable[SampleScore], beta: float) -> PopulationMetrics:
    """Averaged and pooled precision, recall and F_β of a population of scored rollouts.

    Args:
        scores: the :class:`SampleScore` of each rollout (from :func:`syncd.trainer.rewards.score_sample`).
        beta: F_β weight, finite and > 0 (the seed trained with 0.5).

    Raises:
        ValueError (:class:`RewardInputError`): no scores, or an invalid beta.
        TypeError: an element is not a SampleScore.
    """
    b = v.beta(beta)
    items = list(scores)
    if not items:
        raise v.RewardInputError("scores is empty; population metrics need at least one rollout")
    for i, s in enumerate(items):
        if not isinstance(s, SampleScore):
            raise TypeError(f"scores[{i}] must be a SampleScore, got {type(s).__name__}")
    n = len(items)
    # math.fsum: correctly rounded sums, independent of order.
    p_pop = math.fsum(s.precision for s in items) / n
    r_pop = math.fsum(s.recall for s in items) / n
    tp = sum(s.tp for s in items)
    fp = sum(s.fp for s in items)
    fn = sum(s.fn for s in items)
    p_g, r_g = pr_from_counts(tp, fp, fn)
    return PopulationMetrics(
        n=n,
        beta=b,
        p_pop=p_pop,
        r_pop=r_pop,
        fbeta_pop=fbeta(p_pop, r_pop, b),
        tp=tp,
        fp=fp,
        fn=fn,
        p_global=p_g,
        r_global=r_g,
        fbeta_global=fbeta(p_g, r_g, b),
    )
