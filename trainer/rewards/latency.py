"""Latency penalty: estimated rollout latency mapped through the CDF of users' switch-away times.

Two pieces, as in the SWE-check seed's product-alignment phase:

1. :class:`LatencyModel` estimates a rollout's wall-clock latency (seconds) from its completion tokens and
   tool-calling turns with a linear model, ``base_s + s_per_token·tokens + s_per_turn·turns``.
2. :class:`SwitchAwayCDF` turns a histogram of how long users waited before switching away from the tool
   (dogfooding data) into a penalty in [0, 1]: the fraction of users who would already have switched away
   by that latency.

Construction of the penalty curve from buckets ``[e₀, e₁), …, [e_{n-1}, e_n]`` with counts ``c₀ … c_{n-1}``
(total N > 0), as the seed describes it ("normalized so that it starts at 0 for an instant response and is
1 at the tail, linearly interpolated between bucket midpoints"):

* at bucket midpoint ``m_i = (e_i + e_{i+1})/2`` the value is the empirical CDF there, counting the bucket's
  own users as spread evenly over it: ``K_i = (c₀ + … + c_{i-1} + c_i/2) / N``;
* at an instant response (latency 0) the value is 0; if the first bucket starts later (e₀ > 0) the value
  is also 0 at e₀, since nobody switched away before then;
* at the tail, the end e_n of the last bucket, the value is 1, and it stays 1 beyond;
* between consecutive points of this list the curve is linear.

So the penalty at a bucket midpoint is exactly that bucket's mid-rank CDF, and it is non-decreasing in
latency, continuous, 0 at 0 and 1 from e_n on. (Anchoring the ends rather than min-max rescaling the
midpoint curve keeps the meaning "fraction of users lost" and keeps a gradient towards faster responses
below the first midpoint.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import _validate as v

__all__ = ["LatencyModel", "SwitchAwayCDF", "latency_penalty"]


@dataclass(frozen=True)
class LatencyModel:
    """Linear latency estimate: ``base_s + s_per_token·completion_tokens + s_per_turn·tool_turns`` seconds.

    Attributes:
        s_per_token: seconds per completion token (e.g. 0.001 at 1000 tokens/s), ≥ 0.
        s_per_turn: seconds per tool-calling turn (tool execution plus round trip), ≥ 0.
        base_s: fixed overhead per rollout in seconds (queueing, prefill), ≥ 0.

    Raises (on construction):
        ValueError (:class:`RewardInputError`): a coefficient is negative, NaN or infinite.
    """

    s_per_token: float
    s_per_turn: float
    base_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("s_per_token", "s_per_turn", "base_s"):
            object.__setattr__(self, name, v.nonneg(name, getattr(self, name)))

    def estimate(self, completion_tokens: object, tool_turns: object) -> float | np.ndarray:
        """Estimated latency in seconds (≥ 0); scalars or broadcastable arrays of counts ≥ 0.

        Raises ValueError on negative or NaN counts, or shapes that do not broadcast.
        """
        tok = v.nonneg_array("completion_tokens", completion_tokens)
        turns = v.nonneg_array("tool_turns", tool_turns)
        try:
            out = self.base_s + self.s_per_token * tok + self.s_per_turn * turns
        except ValueError as exc:
            raise v.RewardInputError(
                f"completion_tokens shape {tok.shape} and tool_turns shape {turns.shape} do not broadcast"
            ) from exc
        return v.scalar_or_array(out)


@dataclass(frozen=True, eq=False)
class SwitchAwayCDF:
    """The latency penalty curve of a switch-away-time histogram (see the module doc for the construction).

    Args:
        bucket_edges_s: n + 1 bucket edges in seconds, finite, ≥ 0 and strictly increasing (as returned by
            ``numpy.histogram``); bucket i is ``[edges[i], edges[i+1])``.
        bucket_counts: n counts (or weights), finite and ≥ 0, not all 0.

    Raises:
        ValueError (:class:`RewardInputError`): the arrays are not 1-d, their lengths do not match
            (need len(edges) == len(counts) + 1 ≥ 2), an edge is negative or not strictly increasing,
            a count is negative, any value is NaN/inf, or all counts are 0.

    Attributes:
        knots_s, knot_values: the points the curve interpolates linearly (read-only arrays).
        midpoints_s, midpoint_values: the bucket midpoints and the penalty there.
        tail_s: the end of the last bucket, from which the penalty is 1.
    """

    bucket_edges_s: np.ndarray
    bucket_counts: np.ndarray
    knots_s: np.ndarray = field(init=False, repr=False)
    knot_values: np.ndarray = field(init=False, repr=False)
    midpoints_s: np.ndarray = field(init=False, repr=False)
    midpoint_values: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        edges = v.float_array("bucket_edges_s", self.bucket_edges_s, ndim=1)
        counts = v.float_array("bucket_counts", self.bucket_counts, ndim=1)
        if edges.size < 2:
            raise v.RewardInputError(f"bucket_edges_s needs at least 2 edges (one bucket), got {edges.size}")
        if counts.size != edges.size - 1:
            raise v.RewardInputError(
                f"mismatched buckets: {edges.size} bucket_edges_s define {edges.size - 1} buckets, "
                f"but bucket_counts has {counts.size} entries"
            )
        if edges[0] < 0.0:
            raise v.RewardInputError(f"bucket_edges_s must be >= 0 seconds, got first edge {edges[0]}")
        if not (np.diff(edges) > 0.0).all():
            i = int(np.argmin(np.diff(edges) > 0.0))
            raise v.RewardInputError(
                f"bucket_edges_s must be strictly increasing, but edge {i + 1} ({edges[i + 1]}) "
                f"<= edge {i} ({edges[i]})"
            )
        if (counts < 0.0).any():
            raise v.RewardInputError(
                f"bucket_counts must be >= 0, got {counts.min()} at index {int(counts.argmin())}"
            )
        total = counts.sum()
        if not total > 0.0:
            raise v.RewardInputError("bucket_counts are all 0; the switch-away distribution is empty")

        mids = 0.5 * (edges[:-1] + edges[1:])
        cum = np.cumsum(counts)
        k = np.clip((cum - 0.5 * counts) / total, 0.0, 1.0)
        k = np.maximum.accumulate(k)  # guard monotonicity against rounding in the cumulative sum
        xs = [0.0] + ([float(edges[0])] if edges[0] > 0.0 else []) + mids.tolist() + [float(edges[-1])]
        ys = [0.0] + ([0.0] if edges[0] > 0.0 else []) + k.tolist() + [1.0]
        for name, arr in (
            ("bucket_edges_s", edges),
            ("bucket_counts", counts),
            ("knots_s", np.asarray(xs)),
            ("knot_values", np.asarray(ys)),
            ("midpoints_s", mids),
            ("midpoint_values", k),
        ):
            arr.setflags(write=False)
            object.__setattr__(self, name, arr)

    @property
    def tail_s(self) -> float:
        """End of the last bucket in seconds; the penalty is 1 from here on."""
        return float(self.bucket_edges_s[-1])

    def __call__(self, latency_s: object) -> float | np.ndarray:
        """The penalty in [0, 1] for a latency (seconds, ≥ 0; scalar or array).

        Raises ValueError for a negative or NaN latency.
        """
        lat = v.nonneg_array("latency_s", latency_s)
        return v.scalar_or_array(np.interp(lat, self.knots_s, self.knot_values))


def latency_penalty(latency_s: object, bucket_edges_s: object, bucket_counts: object) -> float | np.ndarray:
    """Latency penalty in [0, 1] of ``latency_s`` under a switch-away histogram.

    Shorthand for ``SwitchAwayCDF(bucket_edges_s, bucket_counts)(latency_s)``; build a
    :class:`SwitchAwayCDF` once when scoring many rollouts. 0 at latency 0, the bucket's mid-rank CDF at
    each bucket midpoint, linear in between, 1 from the end of the last bucket on.

    Raises:
        ValueError (:class:`RewardInputError`): see :class:`SwitchAwayCDF`, or a negative/NaN latency.
    """
    return SwitchAwayCDF(bucket_edges_s, bucket_counts)(latency_s)
