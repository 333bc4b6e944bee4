"""Per-request sampling of the reference engine: temperature, top-k, top-p, with a seed per request.

The random draw for a token depends only on the request's seed and the token's absolute position in the
sequence (prompt + generated so far), never on a generator's history: a request that continues on another
engine with its generated tokens in the prompt (migration) draws the same numbers at the same positions.
Everything runs in float32 on the CPU tensor of logits it is given; the same logits, params, seed and
position give the same result. Pure functions; thread-safe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from syncd.engines.protocol import SamplingParams
from syncd.ops.replay import kept_sets

__all__ = ["Sample", "sample", "draw_uniform", "kept_set"]

_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64 finalizer: a well-spread 64-bit hash of ``x``."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def draw_uniform(seed: int, position: int) -> float:
    """The uniform number in [0, 1) that request seed ``seed`` draws at absolute position ``position``."""
    h = _mix64(_mix64(seed & _MASK64) ^ (position & _MASK64))
    return (h >> 11) * (1.0 / (1 << 53))


@dataclass(frozen=True)
class Sample:
    """The chosen token, its log-probability under the sampling distribution (temperature, then top-k and
    top-p, renormalized over the kept set; 0.0 for greedy), and the kept set (ascending token ids: every
    token sampling could have chosen at this step). ``ranked``/``margins``: the kept set in rank order and its
    gaps (``syncd.ops.replay.kept_sets``), what the replay recorder needs to let a trainer rebuild the set."""

    token_id: int
    logprob: float
    kept: torch.Tensor
    ranked: torch.Tensor | None = None
    margins: torch.Tensor | None = None


def _kept(logits: torch.Tensor, params: SamplingParams):
    t = max(0.0, float(params.temperature))
    return kept_sets(logits.reshape(1, -1), t, int(params.top_k), float(params.top_p))


def kept_set(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, logp)``: the token ids sampling may choose from (in descending probability, ties by id) and
    their log-probabilities renormalized over that set, for float32 ``logits`` of shape ``[vocab]``
    (``syncd.ops.replay.kept_sets``, which the trainer rebuilds recorded sets with)."""
    ks = _kept(logits, params)
    return ks.ids, ks.logprobs


def sample(logits: torch.Tensor, params: SamplingParams, seed: int, position: int) -> Sample:
    """Sample one token from ``logits`` (``[vocab]``) for a request with ``seed`` at absolute ``position``."""
    ks = _kept(logits, params)
    ids, logp = ks.ids, ks.logprobs
    if ids.numel() == 1:
        return Sample(int(ids[0]), 0.0 if params.temperature <= 0 else float(logp[0]), ids.clone(), ids, ks.gaps)
    u = draw_uniform(seed, position)
    cum = torch.cumsum(logp.double().exp(), dim=0)
    j = int(torch.searchsorted(cum, torch.tensor([u * float(cum[-1])], dtype=cum.dtype), right=True)[0])
    j = min(j, ids.numel() - 1)
    lp = float(logp[j])
    assert math.isfinite(lp)
    return Sample(int(ids[j]), lp, torch.sort(ids).values, ids, ks.gaps)
