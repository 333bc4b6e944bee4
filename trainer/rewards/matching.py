"""Per-sample scoring of a predicted bug list against the ground-truth bugs of one rollout.

The procedure is the SWE-check seed's, step by step:

1. **Scope check** (optional): ``scope_ok(bug)`` is asked about each predicted bug, in order, and must
   return a bool. It is meant to wrap an LLM judge that says whether a bug report describes a single issue.
   If any predicted bug is judged to aggregate two distinct issues, the sample scores P = R = 0 (the judge is
   not asked about the remaining bugs, and the matcher is not called).
2. **Matching**: ``match(predicted_bug, truth_bug)`` is asked about every (prediction, ground truth) pair and
   must return a bool. Matching is one-to-one: a ground-truth bug can be credited to at most one prediction
   and vice versa, so reporting the same bug twice yields one true positive and one false positive.
   TP is the size of a **maximum** bipartite matching, not a greedy one: with predictions p0, p1 and
   ground truths t0, t1, where p0 matches both and p1 only t0, a greedy pass that gives t0 to p0 leaves p1
   unmatched (TP = 1) although p0→t1, p1→t0 gives TP = 2. Greedy matching therefore under-counts TP and
   would punish the model for the order in which it lists bugs.
3. **Sample precision and recall**, P(τ) = TP / #predicted and R(τ) = TP / #truth, both in [0, 1], with the
   seed's edge cases: no predictions and no ground truth → P = R = 1; exactly one of the two lists empty →
   P = R = 0.

The matcher is called #predicted × #truth times (a maximum matching needs the whole compatibility graph);
bug lists are short, but wrap an expensive matcher in a cache if the same pairs recur.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from . import _validate as v

__all__ = ["SampleScore", "max_bipartite_matching", "score_sample", "sample_pr"]

logger = logging.getLogger(__name__)

P_ = TypeVar("P_")
T_ = TypeVar("T_")


@dataclass(frozen=True)
class SampleScore:
    """The score of one rollout's predicted bug list.

    Attributes:
        precision: P(τ) in [0, 1].
        recall: R(τ) in [0, 1].
        tp: size of the maximum one-to-one matching (0 when the scope check failed).
        fp: predictions left unmatched (all predictions when the scope check failed).
        fn: ground-truth bugs left unmatched (all of them when the scope check failed).
        scope_ok: False when the scope judge rejected a predicted bug (then precision = recall = 0).
        matches: the matched (prediction index, ground-truth index) pairs, sorted by prediction index.

    The counts are what :func:`syncd.trainer.rewards.fbeta_from_counts` pools; a scope failure counts as all
    predictions wrong and all ground truth missed, consistent with its P = R = 0.
    """

    precision: float
    recall: float
    tp: int
    fp: int
    fn: int
    scope_ok: bool
    matches: tuple[tuple[int, int], ...]


def max_bipartite_matching(adjacency: Sequence[Sequence[int]], n_right: int) -> list[tuple[int, int]]:
    """A maximum matching of a bipartite graph, by augmenting paths (Kuhn's algorithm, O(V·E)).

    Args:
        adjacency: ``adjacency[i]`` lists the right vertices (in ``range(n_right)``) that left vertex ``i``
            may be matched to.
        n_right: number of right vertices.

    Returns:
        The matched (left, right) pairs, sorted by left index. No vertex appears twice, and no matching of
        the graph has more pairs.

    Raises:
        ValueError (:class:`RewardInputError`): n_right < 0 or an adjacency entry outside range(n_right).
    """
    if n_right < 0:
        raise v.RewardInputError(f"n_right must be >= 0, got {n_right}")
    for i, row in enumerate(adjacency):
        for j in row:
            if not 0 <= j < n_right:
                raise v.RewardInputError(f"adjacency[{i}] contains {j}, outside range(n_right={n_right})")
    match_left = [-1] * len(adjacency)
    match_right = [-1] * n_right
    for u in range(len(adjacency)):
        # Breadth-first search for an augmenting path from the free left vertex u (iterative: no recursion
        # limit on long lists).
        parent: dict[int, int] = {}  # right vertex -> left vertex it was reached from
        queue = deque([u])
        free = -1
        while queue and free < 0:
            x = queue.popleft()
            for y in adjacency[x]:
                if y in parent:
                    continue
                parent[y] = x
                if match_right[y] < 0:
                    free = y
                    break
                queue.append(match_right[y])
        # Flip the path: each left vertex on it takes the right vertex it was reached through.
        y = free
        while y >= 0:
            x = parent[y]
            previous = match_left[x]
            match_left[x], match_right[y] = y, x
            y = previous if x != u else -1
    return [(i, j) for i, j in enumerate(match_left) if j >= 0]


def score_sample(
    predicted: Iterable[P_],
    truth: Iterable[T_],
    *,
    match: Callable[[P_, T_], Any],
    scope_ok: Callable[[P_], Any] | None = None,
) -> SampleScore:
    """Score one rollout: scope check, one-to-one maximum matching, then P(τ) and R(τ) (see module doc).

    Args:
        predicted: the bugs the model reported (any objects the callables understand).
        truth: the rollout's ground-truth bugs (possibly none).
        match: ``match(predicted_bug, truth_bug) -> bool``, whether a prediction identifies that bug.
        scope_ok: ``scope_ok(predicted_bug) -> bool``, False when the bug aggregates two distinct issues.
            None skips the scope check.

    Returns:
        A :class:`SampleScore`.

    Raises:
        TypeError: ``match``/``scope_ok`` is not callable or returns something other than a bool (a judge
            answering ``"no"`` would otherwise count as True).
    """
    if not callable(match):
        raise TypeError(f"match must be callable, got {type(match).__name__}")
    if scope_ok is not None and not callable(scope_ok):
        raise TypeError(f"scope_ok must be callable or None, got {type(scope_ok).__name__}")
    preds = list(predicted)
    truths = list(truth)
    n_p, n_t = len(preds), len(truths)

    if scope_ok is not None:
        for i, bug in enumerate(preds):
            if not v.flag("scope_ok", scope_ok(bug)):
                logger.debug("scope check rejected predicted bug %d of %d; sample scores 0", i, n_p)
                return SampleScore(0.0, 0.0, tp=0, fp=n_p, fn=n_t, scope_ok=False, matches=())

    if n_p == 0 and n_t == 0:
        return SampleScore(1.0, 1.0, tp=0, fp=0, fn=0, scope_ok=True, matches=())
    if n_p == 0 or n_t == 0:
        return SampleScore(0.0, 0.0, tp=0, fp=n_p, fn=n_t, scope_ok=True, matches=())

    adjacency = [[j for j, t in enumerate(truths) if v.flag("match", match(p, t))] for p in preds]
    pairs = max_bipartite_matching(adjacency, n_t)
    tp = len(pairs)
    return SampleScore(tp / n_p, tp / n_t, tp=tp, fp=n_p - tp, fn=n_t - tp, scope_ok=True, matches=tuple(pairs))


def sample_pr(
    predicted: Iterable[P_],
    truth: Iterable[T_],
    *,
    match: Callable[[P_, T_], Any],
    scope_ok: Callable[[P_], Any] | None = None,
) -> tuple[float, float]:
    """Sample precision and recall (P(τ), R(τ)), each in [0, 1]; see :func:`score_sample` for the contract."""
    s = score_sample(predicted, truth, match=match, scope_ok=scope_ok)
    return s.precision, s.recall
