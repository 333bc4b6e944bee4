"""Reward linearization: a sample-level reward whose average climbs F_β(P_pop, R_pop).

The training target is ``F_β(P_pop, R_pop)`` with ``P_pop = E_τ[P(τ)]`` and ``R_pop = E_τ[R(τ)]``. Averaging
per-sample F_β(P(τ), R(τ)) does not give it, but a reward that is *linear* in P(τ) and R(τ) averages to the
same linear function of P_pop and R_pop. So F_β is replaced by its first-order expansion around the initial
population values (P₀, R₀) = (P_pop,init, R_pop,init):

    F_β(P, R) ≈ F₀ + g_P·(P - P₀) + g_R·(R - R₀),
    g_P = (1+β²)·R₀² / D₀²,  g_R = (1+β²)·β²·P₀² / D₀²,  D₀ = β²·P₀ + R₀,

and the sample reward is that plane shifted and scaled so the coefficient of R is 1 and constants are
dropped (the seed's "force y = 1"):

    reward(τ) = a·P(τ) + b·R(τ),   b = 1,   a = g_P / g_R = (R₀ / (β·P₀))².

Properties (proved in :mod:`syncd.trainer.rewards.fbeta`):

* The constant really is zero: F_β is homogeneous of degree 1, so ``F₀ = g_P·P₀ + g_R·R₀`` and the plane
  is exactly ``g_R·(a·P + R)``. Hence ``g_R · E[reward] = g_R·(a·P_pop + R_pop)`` is the first-order
  F_β, and ranking populations by mean reward is ranking them by that first-order F_β.
* a depends on (P₀, R₀) only through the ratio R₀/P₀. The seed's ``reward = ½·P + R`` at β = 0.5 is implied
  by any initial values with R₀/P₀ = β·√a = 1/(2√2) ≈ 0.354 (e.g. P₀ = 0.6, R₀ ≈ 0.212).
* F_β is concave, so the plane is an upper bound: ``F_β(P, R) ≤ g_R·(a·P + R)``, with equality on the ray
  R/P = R₀/P₀ and a second-order gap ``(1+β²)·β²/D₀³ · (R₀·ΔP - P₀·ΔR)²`` elsewhere.

Recalibration: the seed kept a fixed linearization because the slopes barely moved during its runs, and
notes the method generalizes by re-linearizing at the current population values if they drift far.
:meth:`LinearizedReward.needs_recalibration` and :meth:`LinearizedReward.recalibrated` do that. Note that
rewards from before and after a recalibration are on different scales and should not be mixed in one
advantage baseline.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np

from . import _validate as v
from .fbeta import fbeta, fbeta_grad

__all__ = ["linearize", "LinearizedReward"]

logger = logging.getLogger(__name__)


def linearize(beta: float, p_init: float, r_init: float) -> tuple[float, float]:
    """Coefficients (a, b) of the linearized sample reward ``a·P(τ) + b·R(τ)``, normalized to b = 1.

    Args:
        beta: F_β weight, finite and > 0.
        p_init: initial population precision P_pop,init, in (0, 1].
        r_init: initial population recall R_pop,init, in [0, 1].

    Returns:
        ``(a, 1.0)`` with ``a = (r_init / (beta·p_init))² ≥ 0``, the ratio ∂F_β/∂P : ∂F_β/∂R at the initial
        values. r_init = 0 gives a = 0 (F_β is flat in P along R = 0, so only recall pays to first order).

    Raises:
        ValueError (:class:`RewardInputError`): p_init == 0 (then ∂F_β/∂R = 0 and b cannot be made 1;
            at p_init == r_init == 0 F_β is not even differentiable), a value outside [0, 1] or NaN, or
            beta ≤ 0 / NaN / infinite.
    """
    b = v.beta(beta)
    p0 = v.unit("p_init", p_init)
    r0 = v.unit("r_init", r_init)
    if p0 == 0.0:
        raise v.RewardInputError(
            "p_init must be > 0: at P_pop = 0 the slope of F_beta in recall is 0, so the reward cannot be "
            "normalized to a recall coefficient of 1"
        )
    ratio = r0 / p0 / b
    a = ratio * ratio
    if not math.isfinite(a):
        raise v.RewardInputError(
            f"p_init={p0} is too small relative to r_init={r0}: the slope ratio overflows a float"
        )
    return a, 1.0


@dataclass(frozen=True)
class LinearizedReward:
    """The linearized F_β reward around a calibration point, with recalibration.

    Build it with :meth:`at`. Attributes:
        beta: the F_β weight.
        p_ref, r_ref: the population values it was linearized at.
        a, b: reward coefficients, ``reward = a·P + b·R`` with b = 1.
        scale: ∂F_β/∂R at the calibration point (> 0); ``scale·reward`` averaged over a population is the
            first-order F_β of that population.
    """

    beta: float
    p_ref: float
    r_ref: float
    a: float
    b: float
    scale: float

    def __post_init__(self) -> None:
        # Direct construction is allowed (e.g. restoring from a checkpoint) but must describe a real
        # linearization: re-derive it and compare.
        a, b = linearize(self.beta, self.p_ref, self.r_ref)
        _, g_r = fbeta_grad(self.p_ref, self.r_ref, self.beta)
        for name, got, want in (("a", self.a, a), ("b", self.b, b), ("scale", self.scale, g_r)):
            if not math.isclose(v.real(name, got), want, rel_tol=1e-9, abs_tol=1e-12):
                raise v.RewardInputError(
                    f"{name}={got} is not the linearization of F_beta at beta={self.beta}, "
                    f"p_ref={self.p_ref}, r_ref={self.r_ref} (expected {want}); build it with LinearizedReward.at"
                )

    @classmethod
    def at(cls, beta: float, p_init: float, r_init: float) -> LinearizedReward:
        """Linearize F_β around (p_init, r_init); same arguments and errors as :func:`linearize`."""
        a, b = linearize(beta, p_init, r_init)
        _, g_r = fbeta_grad(p_init, r_init, beta)
        return cls(beta=float(beta), p_ref=float(p_init), r_ref=float(r_init), a=a, b=b, scale=g_r)

    def __call__(self, p: object, r: object) -> float | np.ndarray:
        """Sample reward ``a·p + r`` in [0, a + 1]; p and r are scalars or equal-shape arrays in [0, 1].

        Non-decreasing in each of p and r. Raises ValueError on NaN, values outside [0, 1] or shapes
        that do not broadcast.
        """
        pa = v.unit_array("p", p)
        ra = v.unit_array("r", r)
        try:
            out = self.a * pa + self.b * ra
        except ValueError as exc:
            raise v.RewardInputError(f"p and r shapes {pa.shape} and {ra.shape} do not broadcast") from exc
        return v.scalar_or_array(out)

    @property
    def max_reward(self) -> float:
        """The largest reward, a + b, earned at P = R = 1."""
        return self.a + self.b

    def fbeta_approx(self, p_pop: float, r_pop: float) -> float:
        """The first-order F_β at population values (p_pop, r_pop): ``scale·(a·p_pop + r_pop)``."""
        p = v.unit("p_pop", p_pop)
        r = v.unit("r_pop", r_pop)
        return self.scale * (self.a * p + self.b * r)

    def linearization_error(self, p_pop: float, r_pop: float) -> float:
        """``F_β(p_pop, r_pop) - fbeta_approx(p_pop, r_pop)``; always ≤ 0 up to rounding (F_β is concave)."""
        return fbeta(p_pop, r_pop, self.beta) - self.fbeta_approx(p_pop, r_pop)

    def slope_at(self, p_pop: float, r_pop: float) -> float:
        """The coefficient a a recalibration at (p_pop, r_pop) would give."""
        return linearize(self.beta, p_pop, r_pop)[0]

    def needs_recalibration(self, p_pop: float, r_pop: float, *, rtol: float = 0.1, atol: float = 1e-3) -> bool:
        """True when the slope at (p_pop, r_pop) differs from ``a`` by more than ``max(rtol·a, atol)``.

        Raises ValueError for p_pop == 0 (no linearization exists there) or negative tolerances.
        """
        rt = v.nonneg("rtol", rtol)
        at = v.nonneg("atol", atol)
        return not math.isclose(self.slope_at(p_pop, r_pop), self.a, rel_tol=rt, abs_tol=at)

    def recalibrated(self, p_pop: float, r_pop: float) -> LinearizedReward:
        """A new linearization at the current population values (p_pop, r_pop); logs the slope change."""
        new = LinearizedReward.at(self.beta, p_pop, r_pop)
        logger.info(
            "recalibrated F_beta linearization (beta=%g): P_pop %.4f -> %.4f, R_pop %.4f -> %.4f, a %.4f -> %.4f",
            self.beta, self.p_ref, new.p_ref, self.r_ref, new.r_ref, self.a, new.a,
        )
        return new
