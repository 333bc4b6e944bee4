"""F_β, its gradient, and F_β from pooled counts. Expected values are worked out by hand from
F_β = (1+β²)PR / (β²P + R)."""

from __future__ import annotations

import math

import pytest
from hypothesis import strategies as st

from syncd.trainer.rewards import RewardInputError, fbeta, fbeta_from_counts, fbeta_grad, pr_from_counts
from tests.trainer.rewards._strategies import betas, reward_property, unit


@pytest.mark.parametrize(
    ("p", "r", "beta", "expected"),
    [
        (0.6, 0.3, 0.5, 0.5),  # 1.25*0.18 / (0.25*0.6 + 0.3) = 0.225 / 0.45
        (1.0, 0.5, 1.0, 2.0 / 3.0),  # 2*0.5 / 1.5
        (0.5, 1.0, 2.0, 5.0 / 6.0),  # 5*0.5 / (4*0.5 + 1)
        (0.75, 0.6, 0.5, 5.0 / 7.0),  # 1.25*0.45 / (0.1875 + 0.6)
        (0.4, 0.4, 3.0, 0.4),  # equal P and R: any weighted mean is that value
        (1.0, 1.0, 0.5, 1.0),
        (0.0, 0.7, 0.5, 0.0),
        (0.7, 0.0, 0.5, 0.0),
        (0.0, 0.0, 1.0, 0.0),
    ],
)
def test_fbeta_hand_values(p, r, beta, expected):
    assert fbeta(p, r, beta) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_beta_half_weights_precision():
    # Swapping a high-precision/low-recall pair for the mirror image must lower F_0.5 and raise F_2.
    assert fbeta(0.8, 0.4, 0.5) > fbeta(0.4, 0.8, 0.5)
    assert fbeta(0.8, 0.4, 2.0) < fbeta(0.4, 0.8, 2.0)


def test_beta_limits():
    assert fbeta(0.3, 0.9, 1e4) == pytest.approx(0.9, rel=1e-6)  # β → ∞: recall
    assert fbeta(0.3, 0.9, 1e-4) == pytest.approx(0.3, rel=1e-6)  # β → 0: precision


@pytest.mark.parametrize("beta", [0.0, -0.5, math.nan, math.inf])
def test_bad_beta_raises(beta):
    with pytest.raises(ValueError, match="beta"):
        fbeta(0.5, 0.5, beta)


@pytest.mark.parametrize(
    ("p", "r", "name"), [(math.nan, 0.5, "p"), (0.5, math.nan, "r"), (1.01, 0.5, "p"), (0.5, -0.1, "r")]
)
def test_bad_pr_raises(p, r, name):
    with pytest.raises(RewardInputError, match=rf"^{name}\b"):
        fbeta(p, r, 1.0)


def test_non_number_is_type_error():
    with pytest.raises(TypeError, match="p must be a real number"):
        fbeta("0.5", 0.5, 1.0)


@pytest.mark.parametrize("beta", [0.25, 0.5, 1.0, 2.0])
@pytest.mark.parametrize(("p", "r"), [(0.6, 0.2), (0.3, 0.9), (0.5, 0.5), (0.95, 0.05), (0.1, 0.1)])
def test_gradient_matches_central_differences(p, r, beta):
    h = 1e-6
    fd_p = (fbeta(p + h, r, beta) - fbeta(p - h, r, beta)) / (2 * h)
    fd_r = (fbeta(p, r + h, beta) - fbeta(p, r - h, beta)) / (2 * h)
    g_p, g_r = fbeta_grad(p, r, beta)
    assert g_p == pytest.approx(fd_p, rel=1e-6)
    assert g_r == pytest.approx(fd_r, rel=1e-6)


@reward_property(p=unit, r=unit, beta=betas)
def test_euler_identity_tangent_plane_through_origin(p, r, beta):
    # F is homogeneous of degree 1, so p*dF/dp + r*dF/dr = F.
    if p == 0.0 and r == 0.0:
        return
    g_p, g_r = fbeta_grad(p, r, beta)
    assert p * g_p + r * g_r == pytest.approx(fbeta(p, r, beta), rel=1e-9, abs=1e-12)


def test_gradient_on_the_axes_and_undefined_at_origin():
    b = 0.5
    # F(0, R) = 0 for every R, and F(P, R) ≈ (1+β²)P near P = 0 with R > 0.
    assert fbeta_grad(0.0, 0.4, b) == pytest.approx((1.25, 0.0))
    # F(P, 0) = 0 for every P, and F(P, R) ≈ (1+β²)R/β² near R = 0 with P > 0.
    assert fbeta_grad(0.4, 0.0, b) == pytest.approx((0.0, 1.25 / 0.25))
    with pytest.raises(RewardInputError, match="not differentiable"):
        fbeta_grad(0.0, 0.0, b)


@reward_property(p=unit, r=unit, beta=betas)
def test_fbeta_is_a_mean_of_p_and_r(p, r, beta):
    f = fbeta(p, r, beta)
    if p == 0.0 or r == 0.0:
        assert f == 0.0
    else:
        assert min(p, r) <= f <= max(p, r)


@reward_property(p1=unit, p2=unit, r=unit, beta=betas)
def test_fbeta_monotone_in_precision(p1, p2, r, beta):
    lo, hi = sorted((p1, p2))
    assert fbeta(lo, r, beta) <= fbeta(hi, r, beta)


@reward_property(r1=unit, r2=unit, p=unit, beta=betas)
def test_fbeta_monotone_in_recall(r1, r2, p, beta):
    lo, hi = sorted((r1, r2))
    assert fbeta(p, lo, beta) <= fbeta(p, hi, beta)


def test_counts_hand_value():
    # TP=3, FP=1, FN=2, β=0.5: (1.25*3) / (1.25*3 + 0.25*2 + 1) = 3.75 / 5.25
    assert fbeta_from_counts(3, 1, 2, 0.5) == pytest.approx(5.0 / 7.0, rel=1e-12)
    assert pr_from_counts(3, 1, 2) == pytest.approx((0.75, 0.6))


def test_counts_edge_cases_follow_the_sample_convention():
    assert pr_from_counts(0, 0, 0) == (1.0, 1.0)
    assert fbeta_from_counts(0, 0, 0, 0.5) == 1.0
    assert pr_from_counts(0, 0, 4) == (0.0, 0.0)  # nothing predicted, bugs missed
    assert pr_from_counts(0, 3, 0) == (0.0, 0.0)  # predictions, nothing to find
    assert fbeta_from_counts(0, 3, 4, 1.0) == 0.0


@reward_property(tp=st.integers(0, 1000), fp=st.integers(0, 1000), fn=st.integers(0, 1000), beta=betas)
def test_counts_closed_form(tp, fp, fn, beta):
    b2 = beta * beta
    if tp == 0:
        expected = 1.0 if fp == fn == 0 else 0.0
    else:
        expected = (1 + b2) * tp / ((1 + b2) * tp + b2 * fn + fp)
    assert fbeta_from_counts(tp, fp, fn, beta) == pytest.approx(expected, rel=1e-9, abs=1e-15)


@pytest.mark.parametrize(("args", "name"), [((-1, 0, 0), "tp"), ((0, -2, 0), "fp"), ((0, 0, math.nan), "fn")])
def test_bad_counts_raise(args, name):
    with pytest.raises(ValueError, match=rf"^{name}"):
        fbeta_from_counts(*args, 1.0)


def test_gradient_with_subnormal_inputs():
    # D = β²p + r underflows to 0 when p is the smallest subnormal and r = 0; the ratios must not.
    assert fbeta_grad(5e-324, 0.0, 0.5) == pytest.approx((0.0, 1.25 / 0.25))
    assert fbeta_grad(0.0, 5e-324, 0.5) == pytest.approx((1.25, 0.0))
