"""``syncd.trainer.rewards.SWECheckReward``: the SWE-check reward behind the thin trainer's reward interface (a
``syncd.trainer.rl.tasks.Sample`` in, a float out), worked out by hand: parse, scope judge, maximum matching, the
linearized F_beta reward normalised to [0, 1], the cheating rule and the alternating length penalty."""

from __future__ import annotations

import math

import pytest

from syncd.trainer.rewards import (AlternatingLengthPenalty, CostWeights, LinearizedReward, RewardInputError,
                             SWECheckReward)
from syncd.trainer.rl.tasks import Sample, TaskItem

LIN = LinearizedReward.at(0.5, 0.6, 0.6 / (2 * math.sqrt(2)))  # the seed's 1/2 P + R: a = 0.5


def parse(text: str) -> list[str]:
    return [b.strip() for b in text.split(",") if b.strip()]


def _sample(text, bugs, step=0, tokens=10):
    return Sample(TaskItem(0, "review this diff", meta={"bugs": bugs}), text, "stop", tokens, step)


@pytest.fixture
def reward():
    return SWECheckReward(parse=parse, match=lambda p, t: p == t, scope_ok=lambda p: "+" not in p, linearized=LIN)


def test_by_hand(reward):
    assert LIN.a == pytest.approx(0.5)
    assert reward(_sample("race, typo", ["race"])) == pytest.approx((0.5 * 0.5 + 1.0) / 1.5)   # P 1/2, R 1
    assert reward(_sample("", [])) == pytest.approx(1.0)                                       # nothing to find
    assert reward(_sample("", ["deadlock"])) == 0.0                                            # missed
    assert reward(_sample("leak+race", ["leak", "race"])) == 0.0                               # aggregated report
    r = reward(_sample("off-by-one, null", ["null", "off-by-one", "overflow"]))
    assert r == pytest.approx((0.5 * 1.0 + 2 / 3) / 1.5)
    raw = SWECheckReward(parse=parse, match=lambda p, t: p == t, linearized=LIN, normalize=False)
    assert raw(_sample("race, typo", ["race"])) == pytest.approx(0.5 * 0.5 + 1.0)


def test_cheating_and_length_penalty_by_step():
    alt = AlternatingLengthPenalty.periodic(2, 2, budget=100.0, weights=CostWeights(per_token=1.0, per_turn=0.0,
                                                                                   per_tool_second=0.0))
    r = SWECheckReward(parse=parse, match=lambda p, t: p == t, linearized=LIN, length_penalty=alt,
                       cheated=lambda s: "rm -rf tests" in s.completion)
    assert r(_sample("race", ["race"], step=0, tokens=150)) == pytest.approx(1.0)      # unconstrained phase
    assert r(_sample("race", ["race"], step=2, tokens=150)) == pytest.approx(0.75)     # budget: overrun 0.5
    assert r(_sample("race, rm -rf tests", ["race"], step=0)) == 0.0


def test_bad_input_is_named(reward):
    with pytest.raises(RewardInputError, match="no ground truth under meta\\['bugs'\\]"):
        reward(Sample(TaskItem(3, "p"), "race"))
    with pytest.raises(RewardInputError, match="LinearizedReward"):
        SWECheckReward(parse=parse, match=lambda p, t: True, linearized=(0.5, 1.0))
    with pytest.raises(TypeError):
        SWECheckReward(parse=parse, match=lambda p, t: "yes", linearized=LIN)(_sample("a", ["a"]))
