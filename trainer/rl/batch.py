"""``collate``: rollout sequences padded into one batch, with the generated tokens flattened for
``syncd.ops.replay.kept_logprobs``.

Layout: ``[B, T]`` right-padded (``T`` the longest sequence); the logits row that predicts the token at
``(b, t)`` is ``b * T + t - 1`` of the ``[B * T, V]`` logits (:attr:`RolloutBatch.rows`). Per generated token
``G``: ``rows``, ``targets``, the kept sets (CSR ``kept_ids``/``kept_offsets``), the engine's log-prob, the
version it was sampled with, its sequence ``seq`` and the sampling temperature. Routes are ``[B, T, L, k]``
with :data:`syncd.ops.replay.NO_ROUTE` at padding (never an expert id). Kept sets recorded to be rebuilt from
logits are in ``kept_pending`` (rows of the batch's generated tokens; their CSR rows empty until
:func:`syncd.trainer.rl.kept.fill_kept` rebuilds them, which :func:`syncd.trainer.rl.logprobs.trainer_logprobs` does).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from syncd.ops.replay import NO_ROUTE
from syncd.trainer.rl.rollouts import NO_VERSION, PendingKept, RolloutSequence

__all__ = ["RolloutBatch", "collate"]


@dataclass
class RolloutBatch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    versions: torch.Tensor
    routes: torch.Tensor | None
    rows: torch.Tensor
    targets: torch.Tensor
    kept_ids: torch.Tensor
    kept_offsets: torch.Tensor
    engine_logprobs: torch.Tensor
    token_versions: torch.Tensor
    seq: torch.Tensor
    temperatures: torch.Tensor
    kept_pending: PendingKept | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)

    def to(self, device) -> "RolloutBatch":
        return RolloutBatch(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name).to(device)
                               for f in fields(self)})


def collate(sequences: list[RolloutSequence], *, pad_id: int = 0) -> RolloutBatch:
    """One batch of ``sequences`` (all of one model: vocabulary, experts, routes shape). Raises ValueError for
    an empty list or sequences of different models."""
    if not sequences:
        raise ValueError("collate needs at least one sequence")
    if len({(s.vocab_size, s.num_experts) for s in sequences}) > 1 or \
            len({None if s.routes is None else tuple(s.routes.shape[1:]) for s in sequences}) > 1:
        raise ValueError("sequences of different models (vocabulary, experts or routes shape) in one batch")
    B, T = len(sequences), max(len(s) for s in sequences)
    input_ids = torch.full((B, T), pad_id, dtype=torch.int64)
    attention = torch.zeros((B, T), dtype=torch.int64)
    loss_mask = torch.zeros((B, T), dtype=torch.bool)
    versions = torch.full((B, T), NO_VERSION, dtype=torch.int64)
    first = sequences[0].routes
    routes = None if first is None else torch.full((B, T, *first.shape[1:]), NO_ROUTE, dtype=first.dtype)
    rows, targets, ids, sizes, lps, tver, seq, temps, pending = [], [], [], [], [], [], [], [], []
    generated = 0
    for b, s in enumerate(sequences):
        n = len(s)
        input_ids[b, :n] = s.tokens
        attention[b, :n] = 1
        loss_mask[b, :n] = s.loss_mask
        versions[b, :n] = s.versions
        if routes is not None:
            routes[b, :n] = s.routes
        rows.append(b * T + s.positions - 1)
        targets.append(s.tokens[s.positions])
        ids.append(s.kept_ids.to(torch.int64))
        sizes.append(s.kept_offsets[1:] - s.kept_offsets[:-1])
        lps.append(s.logprobs[s.positions])
        tver.append(s.versions[s.positions])
        seq.append(torch.full((s.positions.numel(),), b, dtype=torch.int64))
        temps.append(torch.full((s.positions.numel(),), s.temperature, dtype=torch.float32))
        pending.append((s.kept_pending, generated))
        generated += s.positions.numel()
    sizes = torch.cat(sizes)
    return RolloutBatch(input_ids, attention, loss_mask, versions, routes, torch.cat(rows), torch.cat(targets),
                        torch.cat(ids), torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)]),
                        torch.cat(lps), torch.cat(tver), torch.cat(seq), torch.cat(temps), PendingKept.cat(pending))
