"""Population metrics: averaged P/R (the training target) versus pooled counts (the comparison)."""

from __future__ import annotations

import pytest

from syncd.trainer.rewards import RewardInputError, fbeta, population_metrics, score_sample


def same(p, t):
    return p == t


def test_population_by_hand():
    scores = [
        score_sample([], [], match=same),  # P = R = 1, counts 0/0/0
        score_sample(["a", "x"], ["a"], match=same),  # P = 1/2, R = 1; TP 1, FP 1
        score_sample([], ["b", "c"], match=same),  # P = R = 0; FN 2
    ]
    m = population_metrics(scores, beta=0.5)
    assert m.n == 3
    assert m.p_pop == pytest.approx(0.5)  # (1 + 1/2 + 0) / 3
    assert m.r_pop == pytest.approx(2 / 3)  # (1 + 1 + 0) / 3
    # F_0.5(1/2, 2/3) = 1.25 * (1/3) / (1/8 + 2/3) = (5/12) / (19/24) = 10/19
    assert m.fbeta_pop == pytest.approx(10 / 19, rel=1e-12)
    assert (m.tp, m.fp, m.fn) == (1, 1, 2)
    assert (m.p_global, m.r_global) == pytest.approx((0.5, 1 / 3))
    # F_0.5(1/2, 1/3) = 1.25 * (1/6) / (1/8 + 1/3) = (5/24) / (11/24) = 5/11
    assert m.fbeta_global == pytest.approx(5 / 11, rel=1e-12)


def test_pooling_lets_many_bug_samples_dominate():
    # One rollout with 10 bugs, all found; one with 1 bug, missed. Pooled recall 10/11, averaged recall 1/2:
    # the averaged metric does not let the many-bug rollout hide the miss (the seed's reason to average).
    bugs = [f"b{i}" for i in range(10)]
    scores = [score_sample(bugs, bugs, match=same), score_sample([], ["z"], match=same)]
    m = population_metrics(scores, beta=1.0)
    assert m.r_global == pytest.approx(10 / 11)
    assert m.r_pop == pytest.approx(0.5)


def test_mean_of_sample_fbeta_is_not_fbeta_of_means():
    # Averaged P and R are both 3/4, so F1_pop = 3/4, but each rollout has F1 = 2/3.
    split = [
        score_sample(["a"], ["a", "b"], match=same),  # P = 1, R = 1/2
        score_sample(["x", "a"], ["a"], match=same),  # P = 1/2, R = 1
    ]
    m = population_metrics(split, beta=1.0)
    naive = sum(fbeta(s.precision, s.recall, 1.0) for s in split) / 2
    assert (m.p_pop, m.r_pop) == pytest.approx((0.75, 0.75))
    assert m.fbeta_pop == pytest.approx(0.75)
    assert naive == pytest.approx(2 / 3)  # F1(1, 1/2) = F1(1/2, 1) = 2/3


def test_scope_failures_count_as_all_wrong_in_pooled_counts():
    s = score_sample(["a+b"], ["a", "b"], match=same, scope_ok=lambda bug: "+" not in bug)
    m = population_metrics([s], beta=0.5)
    assert (m.tp, m.fp, m.fn) == (0, 1, 2)
    assert m.fbeta_pop == 0.0 and m.fbeta_global == 0.0


def test_empty_population_raises():
    with pytest.raises(RewardInputError, match="empty"):
        population_metrics([], beta=0.5)


def test_bad_beta_raises():
    with pytest.raises(ValueError, match="beta"):
        population_metrics([score_sample([], [], match=same)], beta=-1.0)


def test_non_score_is_type_error():
    with pytest.raises(TypeError, match=r"scores\[0\]"):
        population_metrics([(1.0, 1.0)], beta=0.5)
