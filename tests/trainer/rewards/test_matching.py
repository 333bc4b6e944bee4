"""Per-sample scoring: scope check, one-to-one maximum matching, P(τ)/R(τ) and the seeds' edge cases."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from syncd.trainer.rewards import RewardInputError, max_bipartite_matching, sample_pr, score_sample


def pairs_matcher(allowed):
    """A matcher that accepts exactly the (prediction, truth) pairs in ``allowed`` and counts its calls."""
    calls = []

    def match(p, t):
        calls.append((p, t))
        return (p, t) in allowed

    match.calls = calls
    return match


def same(p, t):
    return p == t


# --- the seeds' edge cases -------------------------------------------------------------------------------


def test_no_predictions_and_no_truth_is_perfect():
    assert sample_pr([], [], match=same) == (1.0, 1.0)


def test_no_predictions_but_bugs_exist_is_zero():
    assert sample_pr([], ["bug"], match=same) == (0.0, 0.0)


def test_predictions_but_no_bugs_is_zero():
    assert sample_pr(["bug"], [], match=same) == (0.0, 0.0)


def test_matcher_not_called_when_a_list_is_empty():
    m = pairs_matcher(set())
    sample_pr([], ["a", "b"], match=m)
    sample_pr(["a"], [], match=m)
    assert m.calls == []


# --- precision and recall --------------------------------------------------------------------------------


def test_precision_and_recall_by_hand():
    # 3 predictions, 2 ground-truth bugs, 1 correct: P = 1/3, R = 1/2.
    s = score_sample(["a", "x", "y"], ["a", "b"], match=same)
    assert (s.precision, s.recall) == pytest.approx((1 / 3, 1 / 2))
    assert (s.tp, s.fp, s.fn) == (1, 2, 1)
    assert s.matches == ((0, 0),)
    assert s.scope_ok is True


def test_all_wrong_is_zero():
    assert sample_pr(["x", "y"], ["a"], match=same) == (0.0, 0.0)


def test_one_to_one_duplicate_report_counts_once():
    # The same bug reported twice: one TP, one FP.
    s = score_sample(["a", "a"], ["a"], match=same)
    assert (s.tp, s.fp, s.fn) == (1, 1, 0)
    assert (s.precision, s.recall) == (0.5, 1.0)


def test_one_prediction_cannot_claim_two_bugs():
    # A prediction that matches two ground-truth bugs is credited for one only.
    s = score_sample(["p"], ["t0", "t1"], match=lambda p, t: True)
    assert (s.tp, s.fp, s.fn) == (1, 0, 1)
    assert (s.precision, s.recall) == (1.0, 0.5)


def test_maximum_not_greedy_matching():
    # p0 matches t0 and t1, p1 matches only t0. Greedy (p0 -> t0 first) gets TP = 1; the maximum is 2.
    allowed = {("p0", "t0"), ("p0", "t1"), ("p1", "t0")}
    s = score_sample(["p0", "p1"], ["t0", "t1"], match=pairs_matcher(allowed))
    assert s.tp == 2
    assert (s.precision, s.recall) == (1.0, 1.0)
    assert set(s.matches) == {(0, 1), (1, 0)}


def test_accepts_any_iterables_and_numpy_bool():
    s = score_sample(iter(["a", "b"]), ("b",), match=lambda p, t: np.bool_(p == t))
    assert (s.precision, s.recall) == (0.5, 1.0)


# --- scope check -----------------------------------------------------------------------------------------


def test_aggregated_bug_zeroes_the_sample():
    judged = []

    def scope_ok(bug):
        judged.append(bug)
        return "+" not in bug  # "a+b" aggregates two issues

    m = pairs_matcher({("a", "a"), ("b", "b")})
    s = score_sample(["a", "a+b", "b"], ["a", "b"], match=m, scope_ok=scope_ok)
    assert (s.precision, s.recall) == (0.0, 0.0)
    assert s.scope_ok is False
    assert (s.tp, s.fp, s.fn) == (0, 3, 2)
    assert judged == ["a", "a+b"]  # stops at the first rejection
    assert m.calls == []  # no matching once the sample is zeroed


def test_scope_check_passing_changes_nothing():
    with_judge = score_sample(["a", "x"], ["a"], match=same, scope_ok=lambda bug: True)
    without = score_sample(["a", "x"], ["a"], match=same)
    assert with_judge == without


def test_scope_check_with_no_predictions_keeps_edge_case():
    assert sample_pr([], [], match=same, scope_ok=lambda b: False) == (1.0, 1.0)


@pytest.mark.parametrize("answer", ["yes", 1, None])
def test_non_bool_judge_answer_is_type_error(answer):
    with pytest.raises(TypeError, match="scope_ok"):
        sample_pr(["a"], ["a"], match=same, scope_ok=lambda b: answer)


def test_non_bool_match_answer_is_type_error():
    with pytest.raises(TypeError, match="match"):
        sample_pr(["a"], ["a"], match=lambda p, t: "no")


def test_non_callable_match_is_type_error():
    with pytest.raises(TypeError, match="callable"):
        sample_pr(["a"], ["a"], match=None)


# --- maximum bipartite matching against brute force ------------------------------------------------------


def brute_force_max_matching(adjacency, n_right):
    """Largest number of disjoint edges, by trying every injective partial assignment."""
    best = 0
    n_left = len(adjacency)
    options = [list(row) + [None] for row in adjacency]
    for choice in itertools.product(*options):
        used = [j for j in choice if j is not None]
        if len(used) == len(set(used)):
            best = max(best, len(used))
    assert n_left == 0 or best <= min(n_left, n_right)
    return best


graphs = st.integers(0, 5).flatmap(
    lambda n_right: st.tuples(
        st.lists(st.sets(st.integers(0, max(n_right - 1, 0)), max_size=n_right).map(sorted), max_size=5)
        if n_right
        else st.lists(st.just([]), max_size=5),
        st.just(n_right),
    )
)


@settings(deadline=None, max_examples=200)
@given(graph=graphs)
def test_matching_is_valid_and_maximum(graph):
    adjacency, n_right = graph
    pairs = max_bipartite_matching(adjacency, n_right)
    lefts = [i for i, _ in pairs]
    rights = [j for _, j in pairs]
    assert len(set(lefts)) == len(lefts) and len(set(rights)) == len(rights)  # one-to-one
    assert all(j in adjacency[i] for i, j in pairs)  # only real edges
    assert len(pairs) == brute_force_max_matching(adjacency, n_right)


def test_matching_needs_long_augmenting_path():
    # Left i < n-1 may take right i or i+1 and first takes right i; the last left vertex only accepts
    # right 0, so the only way to match it shifts every earlier vertex by one (augmenting path of length n).
    n = 300
    adjacency = [[i, i + 1] for i in range(n - 1)] + [[0]]
    pairs = max_bipartite_matching(adjacency, n)
    assert len(pairs) == n
    assert dict(pairs)[n - 1] == 0


def test_matching_rejects_out_of_range_vertex():
    with pytest.raises(RewardInputError, match="outside range"):
        max_bipartite_matching([[0, 3]], 2)


# --- properties of sample scores -------------------------------------------------------------------------


@settings(deadline=None, max_examples=200)
@given(
    n_pred=st.integers(0, 5),
    n_truth=st.integers(0, 5),
    edges=st.sets(st.tuples(st.integers(0, 4), st.integers(0, 4))),
)
def test_sample_scores_in_range_and_consistent(n_pred, n_truth, edges):
    preds = list(range(n_pred))
    truths = list(range(n_truth))
    s = score_sample(preds, truths, match=lambda p, t: (p, t) in edges)
    assert 0.0 <= s.precision <= 1.0 and 0.0 <= s.recall <= 1.0
    assert s.tp + s.fp == n_pred and s.tp + s.fn == n_truth
    if n_pred and n_truth:
        assert s.precision == s.tp / n_pred and s.recall == s.tp / n_truth
        adjacency = [[t for t in truths if (p, t) in edges] for p in preds]
        assert s.tp == brute_force_max_matching(adjacency, n_truth)
