"""Reward linearization: coefficients against finite differences of F_β, the seed's ½·P + R, ranking of
candidate policies near the calibration point (with the first-order error measured), and recalibration."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
from hypothesis import strategies as st

from syncd.trainer.rewards import LinearizedReward, RewardInputError, fbeta, linearize
from tests.trainer.rewards._strategies import reward_property, unit

# R0/P0 = 1/(2·sqrt(2)) is the ratio at which β = 0.5 gives a = (R0 / (β·P0))² = 1/2.
P0 = 0.6
R0 = P0 / (2.0 * math.sqrt(2.0))


def fd_slopes(p, r, beta, h=1e-6):
    """Central finite differences of F_β in P and R."""
    d_p = (fbeta(p + h, r, beta) - fbeta(p - h, r, beta)) / (2 * h)
    d_r = (fbeta(p, r + h, beta) - fbeta(p, r - h, beta)) / (2 * h)
    return d_p, d_r


def test_seed_reward_half_p_plus_r_at_beta_half():
    a, b = linearize(0.5, P0, R0)
    assert b == 1.0
    assert a == pytest.approx(0.5, rel=1e-12)


def test_seed_reward_depends_only_on_the_ratio():
    # Any (P0, R0) on the ray R0/P0 = 1/(2√2) gives the same ½·P + R (F_β is homogeneous).
    for p in (0.2, 0.45, 0.9):
        assert linearize(0.5, p, p / (2 * math.sqrt(2)))[0] == pytest.approx(0.5, rel=1e-12)
    # and off the ray it does not: at P0 = R0 the slope is 1/β² = 4.
    assert linearize(0.5, 0.4, 0.4)[0] == pytest.approx(4.0)


@pytest.mark.parametrize("beta", [0.5, 1.0, 2.0])
@pytest.mark.parametrize(("p0", "r0"), [(0.6, 0.2), (0.3, 0.7), (0.5, 0.5), (0.9, 0.05)])
def test_coefficients_match_finite_differences(beta, p0, r0):
    d_p, d_r = fd_slopes(p0, r0, beta)
    a, b = linearize(beta, p0, r0)
    assert b == 1.0
    assert a == pytest.approx(d_p / d_r, rel=1e-6)
    lin = LinearizedReward.at(beta, p0, r0)
    assert lin.scale == pytest.approx(d_r, rel=1e-6)  # ∂F/∂R
    assert lin.scale * lin.a == pytest.approx(d_p, rel=1e-6)  # ∂F/∂P


@reward_property(beta=st.floats(0.1, 5.0), p0=st.floats(0.05, 0.99), r0=st.floats(0.01, 0.99))
def test_coefficients_match_finite_differences_property(beta, p0, r0):
    d_p, d_r = fd_slopes(p0, r0, beta, h=1e-5)
    assert linearize(beta, p0, r0)[0] == pytest.approx(d_p / d_r, rel=1e-4)


def test_dropped_constant_is_zero():
    # The tangent plane F0 + g_P (P - P0) + g_R (R - R0) has zero intercept, so scale·(a·P + R) is it exactly.
    for beta, p0, r0 in [(0.5, P0, R0), (1.0, 0.3, 0.8), (2.0, 0.9, 0.1)]:
        lin = LinearizedReward.at(beta, p0, r0)
        d_p, d_r = fd_slopes(p0, r0, beta)
        f0 = fbeta(p0, r0, beta)
        intercept = f0 - d_p * p0 - d_r * r0
        assert intercept == pytest.approx(0.0, abs=1e-7)
        assert lin.fbeta_approx(p0, r0) == pytest.approx(f0, rel=1e-12)


def test_zero_initial_recall_and_invalid_points():
    assert linearize(0.5, 0.7, 0.0) == (0.0, 1.0)  # F is flat in P along R = 0
    with pytest.raises(RewardInputError, match="p_init must be > 0"):
        linearize(0.5, 0.0, 0.3)
    with pytest.raises(RewardInputError, match="p_init must be > 0"):
        linearize(0.5, 0.0, 0.0)
    with pytest.raises(ValueError, match="beta"):
        linearize(0.0, 0.5, 0.5)
    with pytest.raises(ValueError, match="r_init is NaN"):
        linearize(0.5, 0.5, math.nan)
    with pytest.raises(ValueError, match=r"p_init must be in \[0, 1\]"):
        linearize(0.5, 1.5, 0.5)


# --- first-order error -------------------------------------------------------------------------------------


def predicted_second_order_gap(beta, p0, r0, h_p, h_r):
    """½ hᵀ H h with H = -(2(1+β²)β²/D³)·(R, -P)(R, -P)ᵀ, the Hessian of F_β (derived by hand)."""
    d = beta**2 * p0 + r0
    return -((1 + beta**2) * beta**2 / d**3) * (r0 * h_p - p0 * h_r) ** 2


@pytest.mark.parametrize("theta", np.linspace(0.1, 2 * math.pi, 12, endpoint=False))
def test_first_order_error_is_the_predicted_second_order_term(theta):
    lin = LinearizedReward.at(0.5, P0, R0)
    errors = []
    for delta in (2e-3, 1e-3):
        h_p, h_r = delta * math.cos(theta), delta * math.sin(theta)
        err = lin.linearization_error(P0 + h_p, R0 + h_r)
        expected = predicted_second_order_gap(0.5, P0, R0, h_p, h_r)
        assert err == pytest.approx(expected, rel=0.03, abs=1e-13)
        errors.append(err)
    # second order: halving the step quarters the error
    assert errors[1] == pytest.approx(errors[0] / 4, rel=0.03, abs=1e-13)


def test_no_error_along_the_calibration_ray():
    lin = LinearizedReward.at(0.5, P0, R0)
    for t in (0.5, 0.9, 1.3):
        assert lin.linearization_error(t * P0, t * R0) == pytest.approx(0.0, abs=1e-14)


@reward_property(p=unit, r=unit, beta=st.floats(0.1, 5.0), ratio=st.floats(0.05, 3.0))
def test_linearization_is_an_upper_bound(p, r, beta, ratio):
    # F_β is concave, so its tangent plane lies above it everywhere on [0, 1]².
    p0 = 0.5
    lin = LinearizedReward.at(beta, p0, min(1.0, ratio * p0))
    assert lin.linearization_error(p, r) <= 1e-12


# --- ranking candidate policies ----------------------------------------------------------------------------


def kendall_tau(x, y):
    n = len(x)
    s = 0
    for i in range(n):
        for j in range(i + 1, n):
            s += np.sign(x[i] - x[j]) * np.sign(y[i] - y[j])
    return s / (n * (n - 1) / 2)


def test_mean_linearized_reward_ranks_nearby_policies_like_fbeta():
    beta, delta, n_policies, n_rollouts = 0.5, 0.03, 40, 1000
    lin = LinearizedReward.at(beta, P0, R0)
    rng = np.random.default_rng(1234)
    f_pop, mean_reward, naive, predicted_gap = [], [], [], []
    for _ in range(n_policies):
        # A candidate policy near the calibration point: per-rollout P(τ), R(τ) in {0, 1} (the edge-case
        # values), k of n rollouts at 1, shuffled independently, so P_pop = k_p/n and R_pop = k_r/n exactly.
        k_p = round((P0 + rng.uniform(-delta, delta)) * n_rollouts)
        k_r = round((R0 + rng.uniform(-delta, delta)) * n_rollouts)
        p_tau = rng.permutation(np.r_[np.ones(k_p), np.zeros(n_rollouts - k_p)])
        r_tau = rng.permutation(np.r_[np.ones(k_r), np.zeros(n_rollouts - k_r)])
        p_pop, r_pop = k_p / n_rollouts, k_r / n_rollouts
        f_pop.append(fbeta(p_pop, r_pop, beta))
        mean_reward.append(float(np.mean(lin(p_tau, r_tau))))
        naive.append(np.mean([fbeta(p, r, beta) for p, r in zip(p_tau, r_tau)]))
        predicted_gap.append(predicted_second_order_gap(beta, P0, R0, p_pop - P0, r_pop - R0))
    f_pop, mean_reward, predicted_gap = np.array(f_pop), np.array(mean_reward), np.array(predicted_gap)

    # The first-order error of each candidate, measured: F_β(P_pop, R_pop) - scale·E[reward]. It is never
    # positive (concavity) and is the Hessian's second-order term up to third-order corrections, which are
    # O(delta / R0) ≈ 15% here.
    err = f_pop - lin.scale * mean_reward
    assert (err <= 1e-12).all()
    np.testing.assert_allclose(err, predicted_gap, rtol=0.3, atol=1e-12)
    max_err = np.abs(err).max()

    # Pairs farther apart in F_β than twice the error must be ordered the same by the mean reward ...
    n_checked = 0
    for i in range(n_policies):
        for j in range(n_policies):
            if f_pop[i] - f_pop[j] > 2 * max_err:
                n_checked += 1
                assert mean_reward[i] > mean_reward[j]
    assert n_checked > 0.5 * n_policies * (n_policies - 1) / 2  # that covers most pairs
    # ... and overall the two rankings agree almost perfectly, far better than averaging per-sample F_β.
    tau_lin = kendall_tau(mean_reward, f_pop)
    tau_naive = kendall_tau(np.array(naive), f_pop)
    assert tau_lin > 0.9
    assert tau_lin > tau_naive


def test_naive_mean_of_sample_fbeta_misranks_where_linearized_does_not():
    beta = 0.5
    lin = LinearizedReward.at(beta, P0, R0)
    # Policy A: every rollout P = R = 0.5, so P_pop = R_pop = 0.5, F = 0.5 and mean sample F = 0.5.
    a_scores = [(0.5, 0.5)] * 2
    # Policy B: half (1, 0.1), half (0.1, 1): P_pop = R_pop = 0.55, F = 0.55 > 0.5, but the sample F's are
    # F_0.5(1, 0.1) = 0.125/0.35 and F_0.5(0.1, 1) = 0.125/1.025, mean ≈ 0.240 < 0.5.
    b_scores = [(1.0, 0.1), (0.1, 1.0)]
    f_a, f_b = fbeta(0.5, 0.5, beta), fbeta(0.55, 0.55, beta)
    assert f_b > f_a
    naive_a = np.mean([fbeta(p, r, beta) for p, r in a_scores])
    naive_b = np.mean([fbeta(p, r, beta) for p, r in b_scores])
    assert naive_b == pytest.approx((0.125 / 0.35 + 0.125 / 1.025) / 2)
    assert naive_b < naive_a  # the naive reward prefers the worse policy
    lin_a = np.mean([lin(p, r) for p, r in a_scores])
    lin_b = np.mean([lin(p, r) for p, r in b_scores])
    assert lin_b > lin_a  # the linearized reward does not


# --- the reward itself -------------------------------------------------------------------------------------


def test_reward_values_and_arrays():
    lin = LinearizedReward.at(0.5, P0, R0)
    assert lin(1.0, 1.0) == pytest.approx(1.5)
    assert lin(0.0, 0.0) == 0.0
    assert lin(0.4, 0.2) == pytest.approx(0.5 * 0.4 + 0.2)
    out = lin(np.array([0.0, 1.0, 0.5]), np.array([1.0, 0.0, 0.5]))
    assert isinstance(out, np.ndarray)
    np.testing.assert_allclose(out, [1.0, 0.5, 0.75])
    assert lin.max_reward == pytest.approx(1.5)


def test_reward_rejects_bad_inputs():
    lin = LinearizedReward.at(0.5, P0, R0)
    with pytest.raises(ValueError, match="p contains NaN"):
        lin(math.nan, 0.5)
    with pytest.raises(ValueError, match=r"r must lie in \[0, 1\]"):
        lin(0.5, 1.2)
    with pytest.raises(ValueError, match="do not broadcast"):
        lin(np.zeros(3), np.zeros(2))


@reward_property(beta=st.floats(0.1, 5.0), p0=st.floats(0.01, 1.0), r0=unit, p=unit, r=unit, dp=unit, dr=unit)
def test_reward_in_range_and_monotone(beta, p0, r0, p, r, dp, dr):
    lin = LinearizedReward.at(beta, p0, r0)
    value = lin(p, r)
    assert 0.0 <= value <= lin.a + 1.0 + 1e-12
    p_hi, r_hi = min(1.0, p + dp), min(1.0, r + dr)
    assert lin(p_hi, r) >= value  # monotone in precision
    assert lin(p, r_hi) >= value  # monotone in recall
    if r_hi - r > 1e-9:
        assert lin(p, r_hi) > value  # recall always pays (b = 1)


# --- recalibration -----------------------------------------------------------------------------------------


def test_recalibration(caplog):
    lin = LinearizedReward.at(0.5, P0, R0)
    assert not lin.needs_recalibration(P0, R0)
    assert not lin.needs_recalibration(0.8, 0.8 / (2 * math.sqrt(2)))  # same ratio, same slope
    # Recall has caught up with precision: the slope is now (0.5 / (0.5·0.6))² = 25/9.
    assert lin.slope_at(0.6, 0.5) == pytest.approx(25 / 9)
    assert lin.needs_recalibration(0.6, 0.5)
    assert not lin.needs_recalibration(0.6, 0.5, rtol=5.0)
    with caplog.at_level(logging.INFO, logger="syncd.trainer.rewards.linearize"):
        new = lin.recalibrated(0.6, 0.5)
    assert "recalibrated" in caplog.text
    assert (new.p_ref, new.r_ref, new.beta) == (0.6, 0.5, 0.5)
    assert new.a == pytest.approx(25 / 9)
    assert new.linearization_error(0.6, 0.5) == pytest.approx(0.0, abs=1e-15)
    assert lin.a == pytest.approx(0.5)  # the old one is unchanged (frozen)


def test_recalibration_rejects_negative_tolerance():
    lin = LinearizedReward.at(0.5, P0, R0)
    with pytest.raises(ValueError, match="rtol"):
        lin.needs_recalibration(0.5, 0.5, rtol=-0.1)


def test_direct_construction_is_checked():
    lin = LinearizedReward.at(0.5, P0, R0)
    restored = LinearizedReward(beta=0.5, p_ref=P0, r_ref=R0, a=lin.a, b=1.0, scale=lin.scale)
    assert restored == lin
    with pytest.raises(RewardInputError, match="a=0.7 is not the linearization"):
        LinearizedReward(beta=0.5, p_ref=P0, r_ref=R0, a=0.7, b=1.0, scale=lin.scale)


def test_slope_overflow_raises():
    with pytest.raises(RewardInputError, match="overflows"):
        linearize(0.5, 5e-324, 1.0)
