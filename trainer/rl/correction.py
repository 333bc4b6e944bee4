"""Importance correction for off-policy tokens: the trainer's log-probabilities against the engine's.

For token ``i`` with trainer log-prob ``lp_i`` and engine (sampler) log-prob ``lq_i`` the ratio is ``r_i =
exp(lp_i - lq_i)``. :func:`correct` applies, in this order:

* **band masking** (``band=(alpha, beta)``): tokens with ``r`` outside ``[alpha, beta]`` get weight 0;
* **geometric sequence rejection** (``seq_band=(lo, hi)``): a sequence whose geometric-mean ratio ``exp(mean
  log r)`` over its tokens is outside ``[lo, hi]`` loses every token;
* **truncated IS** (``cap=C``): the surviving tokens get weight ``min(r, C)``.

It reports the **raw** ratio statistics (before any of the above, :class:`RatioStats`: mean, spread, share outside
``[0.9, 1.1]``, max ``|lp - lq|``, two mismatch-KL estimates) next to what the correction did (tokens masked,
sequences rejected, tokens capped, effective sample size of the weights): never only clipped figures.

Per-token versions: a trajectory whose tokens were sampled under several weight versions (an update landed
mid-trajectory) carries one version per token; :func:`select_by_version` takes, per token, the log-prob computed
under that token's own version, and :func:`staleness` summarises the lag to the trainer's version.

:func:`mismatch_by_source` splits ``log pi_trainer - log mu_engine`` into its sources, as a telescoping sum of
recomputations the caller makes: staleness (current weights against the sampler's version), kept-set mass (what
sampling replay removes: the full-vocabulary softmax against the kept-set one), routing (the trainer's own MoE
routes against the engine's) and numerics (what remains with full replay on the same version).

Inputs are tensors of equal shape (``[N]`` tokens, or ``[B, T]`` with a mask; a row is then a sequence); outputs
are detached. Pure functions; thread-safe.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Mapping

import torch

__all__ = ["RatioStats", "Correction", "SourceSplit", "ratio_stats", "band_mask", "sequence_rejection",
           "truncated_is", "effective_sample_size", "correct", "select_by_version", "staleness",
           "mismatch_by_source"]

REPORT_BAND = (0.9, 1.1)


def _prep(trainer_logp: torch.Tensor, engine_logp: torch.Tensor, mask) -> tuple[torch.Tensor, torch.Tensor]:
    if trainer_logp.shape != engine_logp.shape:
        raise ValueError(f"trainer and engine log-probs differ in shape: {tuple(trainer_logp.shape)} vs "
                         f"{tuple(engine_logp.shape)}")
    lr = trainer_logp.detach().double() - engine_logp.detach().to(trainer_logp.device).double()
    m = torch.ones_like(lr, dtype=torch.bool) if mask is None else torch.as_tensor(mask, device=lr.device).bool()
    if m.shape != lr.shape:
        raise ValueError(f"mask has shape {tuple(m.shape)}, the log-probs {tuple(lr.shape)}")
    if bool((~torch.isfinite(lr) & m).any()):
        raise ValueError("a log-probability of a masked-in token is not finite")
    return lr, m


@dataclass(frozen=True)
class RatioStats:
    """Statistics of ``r = exp(lp - lq)`` over ``tokens`` tokens (raw: before any clip or mask). ``outside`` is
    the share of tokens with ``r`` outside ``band``; ``kl_k1`` = mean(lq - lp) and ``kl_k3`` = mean(r - 1 - log r)
    estimate KL(mu || pi) from the sampler's tokens (k3 is never negative)."""

    tokens: int
    mean: float
    std: float
    min: float
    max: float
    log_ratio_mean: float
    max_abs_log_ratio: float
    outside: float
    band: tuple = REPORT_BAND
    kl_k1: float = 0.0
    kl_k3: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def ratio_stats(trainer_logp: torch.Tensor, engine_logp: torch.Tensor, mask=None, *,
                band: tuple = REPORT_BAND) -> RatioStats:
    """Raw statistics of the ratios of the masked-in tokens (NaN statistics for none)."""
    lr, m = _prep(trainer_logp, engine_logp, mask)
    x = lr[m]
    n = int(x.numel())
    if not n:
        nan = float("nan")
        return RatioStats(0, nan, nan, nan, nan, nan, nan, nan, tuple(band), nan, nan)
    r = torch.exp(x)
    return RatioStats(n, float(r.mean()), float(r.std(unbiased=False)), float(r.min()), float(r.max()),
                      float(x.mean()), float(x.abs().max()), float(((r < band[0]) | (r > band[1])).double().mean()),
                      tuple(band), float((-x).mean()), float((r - 1 - x).mean()))


def band_mask(log_ratio: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """True where ``low <= exp(log_ratio) <= high``."""
    if not 0 <= low <= 1 <= high:
        raise ValueError(f"a band must hold 1: need 0 <= low <= 1 <= high, got [{low}, {high}]")
    lo = math.log(low) if low > 0 else -math.inf
    return (log_ratio >= lo) & (log_ratio <= math.log(high))


def _seq_index(shape, mask: torch.Tensor, seq_ids) -> torch.Tensor:
    if seq_ids is not None:
        s = torch.as_tensor(seq_ids, device=mask.device).long()
        if s.shape != tuple(shape):
            raise ValueError(f"seq_ids has shape {tuple(s.shape)}, the tokens {tuple(shape)}")
        if s.numel() and int(s.min()) < 0:
            raise ValueError("seq_ids must be non-negative")
        return s
    if len(shape) == 2:
        return torch.arange(shape[0], device=mask.device)[:, None].expand(shape)
    raise ValueError("sequence rejection needs [B, T] inputs or seq_ids for [N] tokens")


def sequence_rejection(log_ratio: torch.Tensor, mask: torch.Tensor, low: float, high: float, *,
                       seq_ids=None) -> torch.Tensor:
    """Per token: True unless its sequence's geometric-mean ratio (over its masked-in tokens) is outside
    ``[low, high]``. Sequences are rows of ``[B, T]`` inputs, or ``seq_ids`` (``[N]``) for flat ones."""
    seq = _seq_index(log_ratio.shape, mask, seq_ids)
    n = int(seq.max()) + 1 if seq.numel() else 0
    w = mask.double()
    total = torch.zeros(n, dtype=torch.float64, device=mask.device).index_add_(0, seq.reshape(-1),
                                                                              (log_ratio * w).reshape(-1))
    count = torch.zeros(n, dtype=torch.float64, device=mask.device).index_add_(0, seq.reshape(-1), w.reshape(-1))
    geo = total / count.clamp(min=1)
    keep = band_mask(geo, low, high) | (count == 0)
    return keep[seq]


def truncated_is(log_ratio: torch.Tensor, cap: float) -> torch.Tensor:
    """``min(exp(log_ratio), cap)`` (token-level truncated importance sampling)."""
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    return torch.exp(log_ratio.clamp(max=math.log(cap)))


def effective_sample_size(weights: torch.Tensor, mask=None) -> float:
    """``(sum w)^2 / (n * sum w^2)`` over the ``n`` masked-in tokens: 1 for equal weights, toward 0 when few
    tokens carry the weight (0 when every weight is 0; NaN with no tokens)."""
    w = weights.detach().double()
    if mask is not None:
        w = w[torch.as_tensor(mask, device=w.device).bool()]
    n = w.numel()
    if not n:
        return float("nan")
    sq = float((w * w).sum())
    return float(w.sum()) ** 2 / (n * sq) if sq > 0 else 0.0


@dataclass
class Correction:
    """What :func:`correct` decided. ``weights``: per-token weight (0 where masked out or rejected); ``keep``:
    the tokens that kept a weight; ``raw``: ratio statistics before anything was clipped or masked; ``kept``:
    the same over the surviving tokens (before the cap)."""

    weights: torch.Tensor
    keep: torch.Tensor
    raw: RatioStats
    kept: RatioStats
    tokens: int
    band_masked: int
    rejected_sequences: int
    rejected_tokens: int
    capped: int
    ess: float
    weight_mean: float

    def summary(self) -> dict:
        """Flat numbers for a metrics logger: ``raw/...`` before any clip, ``kept/...`` after masking."""
        out = {f"raw/{k}": v for k, v in self.raw.as_dict().items() if k != "band"}
        out.update({f"kept/{k}": v for k, v in self.kept.as_dict().items() if k != "band"})
        out.update(tokens=self.tokens, band_masked=self.band_masked, rejected_sequences=self.rejected_sequences,
                   rejected_tokens=self.rejected_tokens, capped=self.capped, ess=self.ess,
                   weight_mean=self.weight_mean)
        return out


def correct(trainer_logp: torch.Tensor, engine_logp: torch.Tensor, mask=None, *, cap: float | None = 2.0,
            band: tuple | None = None, seq_band: tuple | None = None, seq_ids=None) -> Correction:
    """Token weights for an off-policy loss (see the module docstring for the order of the steps). ``mask``: the
    tokens that count (generated ones); ``cap=None`` leaves the ratios untruncated. Raises ``ValueError`` for
    mismatched shapes, a non-finite log-prob of a counted token, or a band that does not hold 1."""
    lr, m = _prep(trainer_logp, engine_logp, mask)
    raw = ratio_stats(trainer_logp, engine_logp, m)
    keep = m.clone()
    band_masked = 0
    if band is not None:
        inside = band_mask(lr, *band)
        band_masked = int((keep & ~inside).sum())
        keep &= inside
    rejected_seq = rejected_tok = 0
    if seq_band is not None:
        ok = sequence_rejection(lr, keep, *seq_band, seq_ids=seq_ids)
        rejected_tok = int((keep & ~ok).sum())
        seq = _seq_index(lr.shape, keep, seq_ids)
        rejected_seq = int(torch.unique(seq[keep & ~ok]).numel())
        keep &= ok
    w = torch.exp(lr) if cap is None else truncated_is(lr, cap)
    capped = 0 if cap is None else int((keep & (lr > math.log(cap))).sum())
    w = torch.where(keep, w, torch.zeros_like(w)).to(trainer_logp.dtype if trainer_logp.is_floating_point()
                                                     else torch.float32)
    n = int(m.sum())
    return Correction(w, keep, raw, ratio_stats(trainer_logp, engine_logp, keep), n, band_masked, rejected_seq,
                      rejected_tok, capped, effective_sample_size(w, m),
                      float(w[m].double().mean()) if n else float("nan"))


def select_by_version(logps: Mapping[int, torch.Tensor], versions: torch.Tensor, mask=None) -> torch.Tensor:
    """Per token the log-prob computed under that token's own weight version: ``logps[v][i]`` for ``v =
    versions[i]``. Raises ``KeyError`` naming a version a counted token needs that ``logps`` lacks."""
    v = torch.as_tensor(versions)
    m = torch.ones_like(v, dtype=torch.bool) if mask is None else torch.as_tensor(mask, device=v.device).bool()
    need = sorted(int(x) for x in torch.unique(v[m]))
    missing = [x for x in need if x not in logps]
    if missing:
        raise KeyError(f"no log-probs under version(s) {missing}, which {int(torch.isin(v[m], torch.tensor(missing)).sum())} "
                       "counted token(s) were sampled with")
    first = next(iter(logps.values()))
    out = torch.zeros_like(first)
    for ver in need:
        sel = (v == ver).to(first.device)
        out = torch.where(sel, logps[ver].to(first.device), out)
    return out


def staleness(versions: torch.Tensor, current_version: int, mask=None) -> dict:
    """Lag ``current_version - version`` of the counted tokens: ``{"tokens", "mean", "max", "min", "counts":
    {lag: tokens}}``. Raises ``ValueError`` for a token newer than ``current_version``."""
    v = torch.as_tensor(versions).long()
    m = torch.ones_like(v, dtype=torch.bool) if mask is None else torch.as_tensor(mask, device=v.device).bool()
    lag = current_version - v[m]
    if lag.numel() and int(lag.min()) < 0:
        raise ValueError(f"tokens of version {int(v[m].max())} are newer than the trainer's {current_version}")
    if not lag.numel():
        return {"tokens": 0, "mean": float("nan"), "max": 0, "min": 0, "counts": {}}
    vals, counts = torch.unique(lag, return_counts=True)
    return {"tokens": int(lag.numel()), "mean": float(lag.double().mean()), "max": int(lag.max()),
            "min": int(lag.min()), "counts": {int(a): int(b) for a, b in zip(vals, counts)}}


@dataclass
class SourceSplit:
    """``log pi - log mu`` by source (per-token means over the counted tokens, and the mean absolute value): the
    components add up to ``total``. ``routing_disagreement``: share of (token, layer) routes where the trainer's
    own router chose other experts than the engine (None for dense models); ``lag``: :func:`staleness`."""

    tokens: int
    total: dict
    components: dict = field(default_factory=dict)
    routing_disagreement: float | None = None
    lag: dict | None = None


def _mean_abs(x: torch.Tensor, m: torch.Tensor) -> dict:
    y = x.detach().double()[m]
    if not y.numel():
        return {"mean": float("nan"), "mean_abs": float("nan"), "max_abs": float("nan")}
    return {"mean": float(y.mean()), "mean_abs": float(y.abs().mean()), "max_abs": float(y.abs().max())}


def mismatch_by_source(engine_logp: torch.Tensor, replayed: torch.Tensor, mask=None, *,
                       own_routing: torch.Tensor | None = None, full_vocab: torch.Tensor | None = None,
                       current: torch.Tensor | None = None, routing_disagreement: float | None = None,
                       versions=None, current_version: int | None = None) -> SourceSplit:
    """Split the trainer/engine log-ratio by source. Every argument is a per-token log-prob recomputed by the
    trainer, each differing from the previous in one respect:

    * ``replayed``: the sampler's weight version, kept-set and routing replay -> ``numerics = replayed - engine``;
    * ``own_routing``: the same with the trainer's own MoE routes -> ``routing = own_routing - replayed``;
    * ``full_vocab``: also without kept-set replay (softmax over the vocabulary) -> ``kept_set = full_vocab -
      own_routing`` (the log of the kept set's mass: what sampling replay removes, never positive);
    * ``current``: also on the trainer's current weights -> ``staleness = current - full_vocab``.

    A recomputation left out merges its component into the next one. ``total`` is the last given minus the
    engine's."""
    lr, m = _prep(replayed, engine_logp, mask)
    chain = [("numerics", replayed), ("routing", own_routing), ("kept_set", full_vocab), ("staleness", current)]
    comps, prev, top = {}, engine_logp.detach().double(), None
    for name, lp in chain:
        if lp is None:
            continue
        lp = lp.detach().double()
        comps[name] = _mean_abs(lp - prev, m)
        prev, top = lp, lp
    total = _mean_abs(top - engine_logp.detach().double(), m)
    lag = staleness(versions, current_version, m) if versions is not None and current_version is not None else None
    return SourceSplit(int(m.sum()), total, comps, routing_disagreement, lag)
