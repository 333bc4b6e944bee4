"""The SWE-1.7 alternating length penalty and the zero reward for cheating attempts."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import strategies as st

from syncd.trainer.rewards import AlternatingLengthPenalty, CostWeights, LengthPhase, RewardInputError, zero_if_cheating
from tests.trainer.rewards._strategies import reward_property, token_counts, unit

U, B = LengthPhase.UNCONSTRAINED, LengthPhase.BUDGET
# cost = tokens + 100 per turn + 10 per tool-second; budget 10_000
WEIGHTS = CostWeights(per_token=1.0, per_turn=100.0, per_tool_second=10.0)


def make(**kw):
    kw.setdefault("budget", 10_000.0)
    kw.setdefault("weights", WEIGHTS)
    return AlternatingLengthPenalty.periodic(3, 2, **kw)


def test_cost_by_hand():
    assert WEIGHTS.cost(5000, 20, 100.0) == pytest.approx(5000 + 2000 + 1000)
    np.testing.assert_allclose(WEIGHTS.cost([0, 1], [1, 0], [0.0, 0.5]), [100.0, 6.0])


def test_periodic_schedule():
    alt = make()  # 3 unconstrained, 2 budget, repeating
    assert [alt.phase(s) for s in range(11)] == [U, U, U, B, B, U, U, U, B, B, U]
    assert alt.cycle_steps == 5
    starts_with_budget = AlternatingLengthPenalty.periodic(1, 2, budget=1.0, weights=WEIGHTS, start=B)
    assert [starts_with_budget.phase(s) for s in range(6)] == [B, B, U, B, B, U]


def test_custom_segments():
    alt = AlternatingLengthPenalty(((U, 2), (B, 1), (U, 1), (B, 3)), budget=1.0, weights=WEIGHTS)
    assert [alt.phase(s) for s in range(8)] == [U, U, B, U, B, B, B, U]


def test_penalty_by_hand():
    alt = make(max_penalty=0.5, saturate_at=1.0)
    assert alt.penalty(10_000, 0, 0.0) == 0.0  # at budget
    assert alt.penalty(5_000, 10, 0.0) == 0.0  # under budget
    # cost 15_000: overrun 0.5 of the budget -> half of the maximum penalty
    assert alt.penalty(12_000, 20, 100.0) == pytest.approx(0.5 * 0.5)
    assert alt.penalty(20_000, 0, 0.0) == pytest.approx(0.5)  # saturates at twice the budget
    assert alt.penalty(1_000_000, 0, 0.0) == pytest.approx(0.5)
    steep = make(max_penalty=1.0, saturate_at=0.25)
    assert steep.penalty(11_000, 0, 0.0) == pytest.approx(0.4)  # overrun 0.1 / 0.25


def test_reward_by_phase():
    alt = make(max_penalty=0.5)
    kw = dict(tokens=15_000, turns=0, tool_time_s=0.0)  # overrun 0.5 -> penalty 0.25
    assert alt.reward(0, 1.0, **kw) == 1.0  # unconstrained: task reward only
    assert alt.reward(3, 1.0, **kw) == pytest.approx(0.75)  # budget phase
    assert alt.reward(3, 0.0, **kw) == 0.0  # a failure is not penalized further
    assert alt.reward(4, 1.0, tokens=9_000, turns=0, tool_time_s=0.0) == 1.0  # within budget


def test_cheating_zeroes_the_reward_in_every_phase():
    alt = make()
    for step in range(5):
        assert alt.reward(step, 1.0, tokens=10, turns=1, tool_time_s=0.0, cheated=True) == 0.0
    out = alt.reward(
        0, [1.0, 1.0, 0.3], tokens=[10, 10, 10], turns=0, tool_time_s=0.0, cheated=[False, True, False]
    )
    np.testing.assert_allclose(out, [1.0, 0.0, 0.3])


def test_zero_if_cheating():
    assert zero_if_cheating(0.9, True) == 0.0
    assert zero_if_cheating(0.9, False) == 0.9
    assert zero_if_cheating(-0.3, True) == 0.0  # 0 whatever was earned
    np.testing.assert_array_equal(zero_if_cheating([1.0, 2.0], np.array([True, False])), [0.0, 2.0])
    with pytest.raises(TypeError, match="cheated"):
        zero_if_cheating(1.0, 1)
    with pytest.raises(TypeError, match="cheated"):
        zero_if_cheating([1.0], ["yes"])
    with pytest.raises(RewardInputError, match="do not broadcast"):
        zero_if_cheating([1.0, 2.0], [True, False, True])


@reward_property(step=st.integers(0, 1000), base=st.floats(0.0, 10.0), tokens=token_counts, more=token_counts,
                 turns=st.integers(0, 100), tool=st.floats(0.0, 1e4), max_penalty=unit,
                 saturate_at=st.floats(0.01, 10.0))
def test_reward_range_and_monotone_in_cost(step, base, tokens, more, turns, tool, max_penalty, saturate_at):
    alt = make(max_penalty=max_penalty, saturate_at=saturate_at)
    r = alt.reward(step, base, tokens=tokens, turns=turns, tool_time_s=tool)
    assert 0.0 <= r <= base
    assert r >= base * (1.0 - max_penalty) - 1e-12  # the penalty is bounded
    longer = alt.reward(step, base, tokens=tokens + more, turns=turns, tool_time_s=tool)
    assert longer <= r + 1e-12  # more cost never earns more
    if alt.phase(step) is U:
        assert r == base
    assert alt.reward(step, base, tokens=tokens, turns=turns, tool_time_s=tool, cheated=True) == 0.0


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"budget": 0.0}, RewardInputError, "budget must be > 0"),
        ({"budget": math.nan}, RewardInputError, "budget is NaN"),
        ({"max_penalty": 1.5}, RewardInputError, "max_penalty"),
        ({"saturate_at": 0.0}, RewardInputError, "saturate_at"),
        ({"weights": "tokens"}, TypeError, "weights"),
    ],
)
def test_bad_configuration_raises(kwargs, error, message):
    with pytest.raises(error, match=message):
        make(**kwargs)


def test_bad_segments_raise():
    with pytest.raises(RewardInputError, match="empty"):
        AlternatingLengthPenalty((), budget=1.0, weights=WEIGHTS)
    with pytest.raises(RewardInputError, match="at least 1 step"):
        AlternatingLengthPenalty(((U, 0),), budget=1.0, weights=WEIGHTS)
    with pytest.raises(TypeError, match="LengthPhase"):
        AlternatingLengthPenalty((("budget", 3),), budget=1.0, weights=WEIGHTS)
    with pytest.raises(TypeError, match="integer"):
        AlternatingLengthPenalty(((U, 2.5),), budget=1.0, weights=WEIGHTS)


def test_bad_weights_and_inputs_raise():
    with pytest.raises(RewardInputError, match="all 0"):
        CostWeights(0.0, 0.0, 0.0)
    with pytest.raises(RewardInputError, match="per_turn must be >= 0"):
        CostWeights(1.0, -1.0, 0.0)
    alt = make()
    with pytest.raises(RewardInputError, match="base_reward must be >= 0"):
        alt.reward(0, -0.5, tokens=1, turns=0, tool_time_s=0.0)
    with pytest.raises(RewardInputError, match="tokens must be >= 0"):
        alt.reward(0, 1.0, tokens=-1, turns=0, tool_time_s=0.0)
    with pytest.raises(RewardInputError, match="tool_time_s contains NaN"):
        alt.reward(3, 1.0, tokens=1, turns=0, tool_time_s=math.nan)
    with pytest.raises(RewardInputError, match="step must be >= 0"):
        alt.phase(-1)
