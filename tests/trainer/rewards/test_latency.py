"""Latency estimate, the switch-away CDF penalty, and the capability → product two-phase reward."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import strategies as st

from syncd.trainer.rewards import (
    LatencyModel,
    Phase,
    RewardInputError,
    SwitchAwayCDF,
    TwoPhaseReward,
    latency_penalty,
)
from tests.trainer.rewards._strategies import reward_property, token_counts

# 40 users: 10 switched away within 5 s, 20 within 5-10 s, 10 within 10-20 s.
EDGES = [0.0, 5.0, 10.0, 20.0]
COUNTS = [10, 20, 10]


def test_penalty_at_bucket_midpoints_is_the_mid_rank_cdf():
    # Midpoints 2.5, 7.5, 15: (0 + 10/2)/40, (10 + 20/2)/40, (30 + 10/2)/40.
    np.testing.assert_allclose(latency_penalty([2.5, 7.5, 15.0], EDGES, COUNTS), [0.125, 0.5, 0.875])


def test_penalty_is_linear_between_midpoints_and_pinned_at_the_ends():
    cdf = SwitchAwayCDF(EDGES, COUNTS)
    assert cdf(0.0) == 0.0  # instant response
    assert cdf(1.0) == pytest.approx(0.125 * 1.0 / 2.5)  # between 0 and the first midpoint
    assert cdf(5.0) == pytest.approx(0.125 + (5.0 - 2.5) / (7.5 - 2.5) * (0.5 - 0.125))  # 0.3125
    assert cdf(10.0) == pytest.approx(0.5 + (10.0 - 7.5) / (15.0 - 7.5) * (0.875 - 0.5))  # 0.625
    assert cdf(17.5) == pytest.approx(0.875 + (17.5 - 15.0) / (20.0 - 15.0) * 0.125)  # toward the tail
    assert cdf(20.0) == 1.0  # the tail
    assert cdf(3600.0) == 1.0
    assert cdf.tail_s == 20.0


def test_midpoint_values_match_raw_switch_times_spread_evenly_in_buckets():
    # Independent check: build raw switch-away times spread evenly (symmetrically) inside each bucket,
    # histogram them with numpy, and compare the penalty at each midpoint with the raw empirical CDF there
    # (a user exactly at the midpoint counts half).
    edges = np.array([0.0, 2.0, 3.0, 7.0, 12.0, 30.0])
    per_bucket = [6, 2, 8, 4, 10]
    raw = np.concatenate(
        [lo + (np.arange(c) + 0.5) / c * (hi - lo) for lo, hi, c in zip(edges[:-1], edges[1:], per_bucket)]
    )
    counts, _ = np.histogram(raw, bins=edges)
    cdf = SwitchAwayCDF(edges, counts)
    for m in 0.5 * (edges[:-1] + edges[1:]):
        raw_cdf = (np.sum(raw < m) + 0.5 * np.sum(raw == m)) / raw.size
        assert cdf(m) == pytest.approx(raw_cdf, abs=1e-12)


def test_histogram_not_starting_at_zero():
    # Nobody switches away before 2 s, so anything up to 2 s costs nothing.
    cdf = SwitchAwayCDF([2.0, 4.0, 6.0], [1, 1])
    np.testing.assert_allclose(cdf([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0]), [0, 0, 0, 0.25, 0.5, 0.75, 1.0])


def test_empty_buckets():
    cdf = SwitchAwayCDF([0.0, 1.0, 2.0, 3.0], [0, 4, 0])
    np.testing.assert_allclose(cdf.midpoint_values, [0.0, 0.5, 1.0])
    assert cdf(0.5) == 0.0 and cdf(1.5) == 0.5 and cdf(2.5) == 1.0


def test_single_bucket():
    cdf = SwitchAwayCDF([0.0, 10.0], [7])
    np.testing.assert_allclose(cdf([0.0, 2.5, 5.0, 7.5, 10.0]), [0.0, 0.25, 0.5, 0.75, 1.0])


def test_curve_arrays_are_read_only():
    cdf = SwitchAwayCDF(EDGES, COUNTS)
    with pytest.raises(ValueError):
        cdf.knot_values[0] = 0.5


@pytest.mark.parametrize(
    ("edges", "counts", "message"),
    [
        ([0.0, 5.0, 10.0], [1, 2, 3], "mismatched buckets"),
        ([0.0, 5.0, 10.0, 20.0], [1, 2], "mismatched buckets"),
        ([0.0], [], "at least 2 edges"),
        ([0.0, 5.0, 5.0], [1, 1], "strictly increasing"),
        ([0.0, 6.0, 5.0], [1, 1], "strictly increasing"),
        ([-1.0, 5.0], [1], ">= 0 seconds"),
        ([0.0, 5.0, 10.0], [1, -1], "bucket_counts must be >= 0"),
        ([0.0, 5.0, 10.0], [0, 0], "all 0"),
        ([0.0, math.nan], [1], "bucket_edges_s contains NaN"),
        ([0.0, 5.0], [math.nan], "bucket_counts contains NaN"),
        ([0.0, math.inf], [1], "finite"),
        ([[0.0, 5.0]], [1], "1-dimensional"),
    ],
)
def test_bad_histograms_raise(edges, counts, message):
    with pytest.raises(RewardInputError, match=message):
        SwitchAwayCDF(edges, counts)


@pytest.mark.parametrize(("latency", "message"), [(-0.1, ">= 0"), (math.nan, "NaN")])
def test_bad_latency_raises(latency, message):
    with pytest.raises(ValueError, match=f"latency_s.*{message}"):
        latency_penalty(latency, EDGES, COUNTS)


histograms = st.integers(1, 8).flatmap(
    lambda n: st.tuples(
        st.lists(st.floats(0.01, 100.0), min_size=n, max_size=n),  # bucket widths
        st.floats(0.0, 50.0),  # first edge
        st.lists(st.integers(0, 1000), min_size=n, max_size=n).filter(lambda c: sum(c) > 0),
    )
)


@reward_property(h=histograms, t1=st.floats(0.0, 1000.0), t2=st.floats(0.0, 1000.0))
def test_penalty_bounded_and_monotone(h, t1, t2):
    widths, first, counts = h
    edges = first + np.concatenate([[0.0], np.cumsum(widths)])
    cdf = SwitchAwayCDF(edges, counts)
    lo, hi = sorted((t1, t2))
    p_lo, p_hi = cdf(lo), cdf(hi)
    assert 0.0 <= p_lo <= p_hi <= 1.0
    assert cdf(0.0) == 0.0
    assert cdf(float(edges[-1])) == 1.0
    # the midpoint values are the mid-rank CDF of the histogram
    c = np.asarray(counts, dtype=float)
    expected = (np.cumsum(c) - c / 2) / c.sum()
    np.testing.assert_allclose(cdf(0.5 * (edges[:-1] + edges[1:])), expected, atol=1e-12)


# --- latency model -----------------------------------------------------------------------------------------


def test_latency_model_by_hand():
    m = LatencyModel(s_per_token=0.001, s_per_turn=1.5, base_s=0.5)
    assert m.estimate(3000, 4) == pytest.approx(0.5 + 3.0 + 6.0)
    np.testing.assert_allclose(m.estimate([0, 1000], [0, 2]), [0.5, 0.5 + 1.0 + 3.0])


@pytest.mark.parametrize(
    "kwargs", [{"s_per_token": -1e-3, "s_per_turn": 1.0}, {"s_per_token": 1e-3, "s_per_turn": math.nan}]
)
def test_latency_model_rejects_bad_coefficients(kwargs):
    with pytest.raises(RewardInputError):
        LatencyModel(**kwargs)


def test_latency_model_rejects_bad_counts():
    m = LatencyModel(s_per_token=0.001, s_per_turn=1.0)
    with pytest.raises(RewardInputError, match="completion_tokens"):
        m.estimate(-5, 1)
    with pytest.raises(RewardInputError, match="do not broadcast"):
        m.estimate([1, 2, 3], [1, 2])


# --- two-phase schedule ------------------------------------------------------------------------------------


def make_two_phase(start=100, weight=0.4):
    return TwoPhaseReward(
        product_start_step=start,
        latency_weight=weight,
        latency_model=LatencyModel(s_per_token=0.001, s_per_turn=1.0),
        switch_away=SwitchAwayCDF(EDGES, COUNTS),
    )


def test_phases():
    sched = make_two_phase(start=100)
    assert sched.phase(0) is Phase.CAPABILITY
    assert sched.phase(99) is Phase.CAPABILITY
    assert sched.phase(100) is Phase.PRODUCT
    assert sched.phase(10**6) is Phase.PRODUCT
    assert make_two_phase(start=0).phase(0) is Phase.PRODUCT


def test_capability_phase_ignores_latency():
    sched = make_two_phase()
    assert sched.reward(5, 1.2, completion_tokens=50_000, tool_turns=30) == 1.2


def test_product_phase_subtracts_weighted_penalty():
    sched = make_two_phase(weight=0.4)
    # 2500 tokens at 1 ms + 5 turns at 1 s = 7.5 s, the second midpoint: penalty 0.5.
    assert sched.penalty(2500, 5) == pytest.approx(0.5)
    assert sched.reward(100, 1.2, completion_tokens=2500, tool_turns=5) == pytest.approx(1.2 - 0.4 * 0.5)
    # Instant and very slow rollouts: no penalty, full weight.
    assert sched.reward(100, 1.2, completion_tokens=0, tool_turns=0) == pytest.approx(1.2)
    assert sched.reward(100, 1.2, completion_tokens=10**6, tool_turns=0) == pytest.approx(0.8)
    out = sched.reward(100, [1.0, 0.5], completion_tokens=[2500, 0], tool_turns=[5, 0])
    np.testing.assert_allclose(out, [1.0 - 0.2, 0.5])


@reward_property(base=st.floats(0.0, 1.5), tokens=token_counts, turns=st.integers(0, 50), extra=st.integers(0, 10_000))
def test_product_reward_in_range_and_decreasing_in_latency(base, tokens, turns, extra):
    sched = make_two_phase(weight=0.4)
    r = sched.reward(200, base, completion_tokens=tokens, tool_turns=turns)
    assert base - 0.4 - 1e-12 <= r <= base + 1e-12
    slower = sched.reward(200, base, completion_tokens=tokens + extra, tool_turns=turns + 1)
    assert slower <= r + 1e-12


def test_two_phase_validation():
    with pytest.raises(RewardInputError, match="latency_weight"):
        make_two_phase(weight=-0.1)
    with pytest.raises(RewardInputError, match="product_start_step"):
        make_two_phase(start=-1)
    with pytest.raises(TypeError, match="step"):
        make_two_phase().phase(1.5)
    with pytest.raises(RewardInputError, match="base_reward contains NaN"):
        make_two_phase().reward(0, math.nan, completion_tokens=1, tool_turns=1)
    with pytest.raises(RewardInputError, match="tool_turns"):
        make_two_phase().reward(0, 1.0, completion_tokens=1, tool_turns=-1)
