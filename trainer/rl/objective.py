"""The policy-gradient loss of the thin trainer, with replayed log-probabilities and importance correction.

For the generated tokens ``i`` of a batch, with ``log pi_i`` the trainer's log-prob under its current weights
(:func:`syncd.trainer.rl.logprobs.trainer_logprobs`: kept-set replay, and routing replay for MoE models), ``log mu_i``
the engine's (recorded with the token; sampled with weights of an older version when the rollout is stale) and
``A_i`` the advantage of the token's sequence (:func:`syncd.trainer.rl.buffer.group_advantages`)::

    loss = -sum_i w_i * A_i * log pi_i / N        w_i = correction weight of r_i = pi_i / mu_i (detached)

``w_i`` comes from :func:`syncd.trainer.rl.correction.correct`: by default token-level truncated importance sampling,
``min(r_i, C)`` with ``C = 2`` (``is_cap``); ``is_band`` masks tokens whose ratio is outside a band and
``is_seq_band`` rejects whole sequences by their geometric-mean ratio. ``N`` is the number of generated tokens
of the whole step, over every data-parallel rank, so that the ranks' summed gradients are the gradient of the
step's token mean. Sequences run in micro-batches of ``micro_batch`` (one backward each; the same sum).

:func:`step_diagnostics` reports, over the tokens of every rank, the correction's raw ratio statistics (before
any clip: mean, spread, share outside [0.9, 1.1], max |log r|, the mismatch KL estimates k1 and k3 of
KL(mu || pi)), what the correction did, and the tokens' staleness against the trainer's version.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from syncd.trainer.rl import correction as C
from syncd.trainer.rl.batch import collate
from syncd.trainer.rl.logprobs import trainer_logprobs

__all__ = ["LossConfig", "TokenRecord", "policy_gradient_loss", "step_diagnostics"]


@dataclass(frozen=True)
class LossConfig:
    """``is_cap``: truncation of the IS ratio (None: none); ``is_band``/``is_seq_band``: ``(low, high)`` or None;
    ``micro_batch``: sequences per forward/backward."""

    is_cap: float | None = 2.0
    is_band: tuple | None = None
    is_seq_band: tuple | None = None
    micro_batch: int = 64

    def __post_init__(self):
        if self.is_cap is not None and not self.is_cap > 0:
            raise ValueError(f"the IS cap must be > 0, got {self.is_cap}")
        for name, band in (("is_band", self.is_band), ("is_seq_band", self.is_seq_band)):
            if band is not None and not (len(band) == 2 and 0 <= band[0] <= 1 <= band[1]):
                raise ValueError(f"{name} must be (low, high) with 0 <= low <= 1 <= high, got {band}")
        if self.micro_batch < 1:
            raise ValueError(f"micro_batch must be >= 1, got {self.micro_batch}")


@dataclass
class TokenRecord:
    """Per generated token of one rank's share of a step (detached, CPU): trainer and engine log-probs, the
    sampling version, the sequence index (within the rank), the correction weight and the advantage."""

    trainer_logprobs: torch.Tensor
    engine_logprobs: torch.Tensor
    versions: torch.Tensor
    seq: torch.Tensor
    weights: torch.Tensor
    advantages: torch.Tensor
    routing_disagreement: float | None = None

    @staticmethod
    def cat(records: list["TokenRecord"]) -> "TokenRecord":
        """One record of several (sequence indices offset so they stay distinct)."""
        seqs, off = [], 0
        for r in records:
            seqs.append(r.seq + off)
            off += int(r.seq.max()) + 1 if r.seq.numel() else 0
        dis = [r.routing_disagreement for r in records if r.routing_disagreement is not None]
        return TokenRecord(*(torch.cat([getattr(r, k) for r in records]) for k in
                             ("trainer_logprobs", "engine_logprobs", "versions")), torch.cat(seqs),
                           torch.cat([r.weights for r in records]), torch.cat([r.advantages for r in records]),
                           sum(dis) / len(dis) if dis else None)


def policy_gradient_loss(model: torch.nn.Module, sequences: list, advantages: torch.Tensor, *, normalizer: float,
                         config: LossConfig = LossConfig(), backend: str = "auto") -> tuple[float, TokenRecord]:
    """Accumulate the gradient of this rank's share of the loss into ``model``'s ``.grad`` (see the module
    docstring) and return ``(its loss value, the tokens' record)``. ``advantages``: one per sequence."""
    if len(sequences) != advantages.numel():
        raise ValueError(f"{len(sequences)} sequences but {advantages.numel()} advantages")
    if not normalizer > 0:
        raise ValueError(f"the token normalizer must be > 0, got {normalizer}")
    total, records = 0.0, []
    for start in range(0, len(sequences), config.micro_batch):
        chunk = sequences[start:start + config.micro_batch]
        batch = collate(chunk)
        out = trainer_logprobs(model, batch, backend=backend)
        c = C.correct(out.logprobs.detach(), batch.engine_logprobs, cap=config.is_cap, band=config.is_band,
                      seq_band=config.is_seq_band, seq_ids=batch.seq)
        adv = advantages[start:start + len(chunk)].to(out.logprobs.dtype)[batch.seq]
        loss = -(c.weights.to(out.logprobs.dtype) * adv * out.logprobs).sum() / normalizer
        loss.backward()
        total += float(loss.detach())
        records.append(TokenRecord(out.logprobs.detach().float().cpu(), batch.engine_logprobs.float().cpu(),
                                   batch.token_versions.cpu(), batch.seq.cpu(), c.weights.detach().float().cpu(),
                                   adv.detach().float().cpu(), out.disagreement))
    return total, TokenRecord.cat(records)


def step_diagnostics(record: TokenRecord, current_version: int, config: LossConfig = LossConfig()) -> dict:
    """Flat numbers for the step's metrics line from the tokens of every rank (see the module docstring)."""
    c = C.correct(record.trainer_logprobs, record.engine_logprobs, cap=config.is_cap, band=config.is_band,
                  seq_band=config.is_seq_band, seq_ids=record.seq)
    s = c.summary()
    lag = C.staleness(record.versions, current_version)
    out = {"is_mean": s["raw/mean"], "is_std": s["raw/std"], "is_min": s["raw/min"], "is_max": s["raw/max"],
           "is_outside": s["raw/outside"], "max_abs_log_ratio": s["raw/max_abs_log_ratio"],
           "kl_k3": s["raw/kl_k3"], "kl_k1": s["raw/kl_k1"], "is_capped": s["capped"],
           "is_band_masked": s["band_masked"], "is_rejected_sequences": s["rejected_sequences"],
           "is_ess": s["ess"], "is_weight_mean": s["weight_mean"],
           "staleness_mean": lag["mean"], "staleness_max": lag["max"],
           "staleness_counts": {str(k): v for k, v in lag["counts"].items()}}
    if record.routing_disagreement is not None:
        out["routing_disagreement"] = record.routing_disagreement
    return out
