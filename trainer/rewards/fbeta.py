"""The F_β score, its gradient, and F_β from global TP/FP/FN counts.

Definitions (β > 0; precision P and recall R in [0, 1]):

    F_β(P, R) = (1 + β²) · P · R / (β² · P + R)          with F_β(0, 0) = 0 (its limit)

F_β is the weighted harmonic mean of P and R, ``(1 + β²) / (β²/R + 1/P)``, so it lies between min(P, R)
and max(P, R). β < 1 weights precision more (the SWE-check seed moved from β = 1 to β = 0.5 because β = 1
produced too many false positives); β → ∞ tends to R, β → 0 tends to P.

Two facts the linearization in :mod:`syncd.trainer.rewards.linearize` rests on:

* F_β is positively homogeneous of degree 1: F_β(tP, tR) = t·F_β(P, R). By Euler's theorem
  ``P·∂F/∂P + R·∂F/∂R = F``, so the tangent plane at any point passes through the origin.
* F_β is concave on P, R > 0 (its Hessian is ``-(2(1+β²)β² / D³)·v vᵀ`` with ``D = β²P + R`` and
  ``v = (R, -P)``), so the tangent plane lies on or above F_β everywhere.
"""

from __future__ import annotations

from . import _validate as v

__all__ = ["fbeta", "fbeta_grad", "pr_from_counts", "fbeta_from_counts"]


def fbeta(p: float, r: float, beta: float) -> float:
    """F_β of precision ``p`` and recall ``r``.

    Args:
        p: precision in [0, 1].
        r: recall in [0, 1].
        beta: weight of recall relative to precision, finite and > 0.

    Returns:
        F_β in [min(p, r), max(p, r)] ⊂ [0, 1]; 0.0 when p == 0 or r == 0 (including p == r == 0).

    Raises:
        ValueError (:class:`RewardInputError`): p or r outside [0, 1] or NaN; beta ≤ 0, NaN or infinite.
        TypeError: an argument is not a real number.
    """
    p = v.unit("p", p)
    r = v.unit("r", r)
    b2 = v.beta(beta) ** 2
    if p == 0.0 or r == 0.0:
        return 0.0
    # Harmonic form: no underflow of p*r for tiny p, r.
    f = (1.0 + b2) / (b2 / r + 1.0 / p)
    # F_β is a weighted mean of p and r; clamp away a possible last-ulp excursion.
    return min(max(f, min(p, r)), max(p, r))


def fbeta_grad(p: float, r: float, beta: float) -> tuple[float, float]:
    """The gradient (∂F_β/∂P, ∂F_β/∂R) at (p, r).

    With ``D = β²·p + r``:  ``∂F/∂P = (1+β²)·r² / D²`` and ``∂F/∂R = (1+β²)·β²·p² / D²``. Both are ≥ 0
    (F_β is non-decreasing in each argument) and ``p·∂F/∂P + r·∂F/∂R = F_β(p, r)``.

    At (0, 0) F_β is not differentiable (the directional slope depends on the direction), so that point is
    rejected. At p = 0 < r the gradient is (1+β², 0); at r = 0 < p it is (0, (1+β²)/β²).

    Raises:
        ValueError (:class:`RewardInputError`): p == r == 0, or any argument invalid as in :func:`fbeta`.
    """
    p = v.unit("p", p)
    r = v.unit("r", r)
    b2 = v.beta(beta) ** 2
    if p == 0.0 and r == 0.0:
        raise v.RewardInputError("F_beta is not differentiable at p == r == 0; its gradient is undefined there")
    k = 1.0 + b2
    # r/D and p/D written so that tiny (subnormal) p or r cannot make D underflow to 0.
    r_over_d = 1.0 / (1.0 + b2 * (p / r)) if r > 0.0 else 0.0
    p_over_d = 1.0 / (b2 + r / p) if p > 0.0 else 0.0
    return k * r_over_d * r_over_d, k * b2 * p_over_d * p_over_d


def pr_from_counts(tp: float, fp: float, fn: float) -> tuple[float, float]:
    """Precision TP/(TP+FP) and recall TP/(TP+FN), with the SWE-check edge cases.

    Counts may be integers or non-negative rates (only their ratios matter). Edge cases follow the
    per-sample convention of :func:`syncd.trainer.rewards.sample_pr`: nothing predicted and nothing to find
    (TP = FP = FN = 0) gives (1, 1); otherwise a 0/0 ratio (no predictions, or no ground truth) gives 0.

    Raises:
        ValueError (:class:`RewardInputError`): a count is negative, NaN or infinite.
    """
    tp = v.nonneg("tp", tp)
    fp = v.nonneg("fp", fp)
    fn = v.nonneg("fn", fn)
    if tp == fp == fn == 0.0:
        return 1.0, 1.0
    p = tp / (tp + fp) if tp + fp > 0.0 else 0.0
    r = tp / (tp + fn) if tp + fn > 0.0 else 0.0
    return p, r


def fbeta_from_counts(tp: float, fp: float, fn: float, beta: float) -> float:
    """F_β of the global precision and recall obtained from pooled TP/FP/FN counts.

    Equals ``(1+β²)·TP / ((1+β²)·TP + β²·FN + FP)`` when TP > 0, 0 when TP = 0 and FP + FN > 0, and 1 when
    all counts are 0 (see :func:`pr_from_counts`). This is the aggregation the seed considered and rejected
    for training, because pooling lets samples with many ground-truth bugs dominate; it is provided for
    comparison with :func:`syncd.trainer.rewards.population_metrics`.

    Raises:
        ValueError (:class:`RewardInputError`): a count is negative/NaN/infinite, or beta is invalid.
    """
    p, r = pr_from_counts(tp, fp, fn)
    return fbeta(p, r, beta)
