"""``kept_logprobs_vocab_parallel``: kept-set log-probabilities of logits sharded over the vocabulary across
tensor-parallel ranks (each rank holds columns ``[vocab_start, vocab_start + V_local)``): every rank reduces the
kept ids it owns to a partial max and sum of exponentials, two all-reduces (max, then sum) give the kept
``logsumexp``, a third (sum) gives the target's logit from the rank that owns it. The backward needs no
communication: each rank writes the gradient of its own kept entries. Plain PyTorch ops; collective calls go to
``torch.distributed`` on ``group`` (any backend: gloo on CPUs, NCCL on GPUs).

Thread-safety: collectives must be issued in the same order on every rank of ``group``, as usual.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from syncd.ops._replay_layout import kept_rows
from syncd.ops.replay._kept import check_csr

__all__ = ["kept_logprobs_vocab_parallel"]


class _VocabParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local_logits, ids, offsets, targets, vocab_start, temperature, group):
        T, Vp = local_logits.shape
        dev = local_logits.device
        rows = kept_rows(offsets)
        own = (ids >= vocab_start) & (ids < vocab_start + Vp)
        lrows, lids = rows[own], ids[own] - vocab_start
        z = local_logits[lrows, lids].float() / temperature
        m = torch.full((T,), float("-inf"), device=dev).scatter_reduce(0, lrows, z, "amax")
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        s = torch.zeros(T, device=dev).index_add(0, lrows, torch.exp(z - m[lrows]))
        dist.all_reduce(s, op=dist.ReduceOp.SUM, group=group)
        lse = m + torch.log(s)
        mine = (targets >= vocab_start) & (targets < vocab_start + Vp)
        za = local_logits[torch.arange(T, device=dev), (targets - vocab_start).clamp(0, Vp - 1)].float() / temperature
        za = torch.where(mine, za, torch.zeros_like(za))
        dist.all_reduce(za, op=dist.ReduceOp.SUM, group=group)
        ctx.save_for_backward(z, lrows, lids, targets, lse)
        ctx.meta = (float(temperature), int(vocab_start), tuple(local_logits.shape), local_logits.dtype)
        return za - lse

    @staticmethod
    def backward(ctx, grad):
        z, lrows, lids, targets, lse = ctx.saved_tensors
        temperature, vocab_start, shape, dtype = ctx.meta
        hit = (lids + vocab_start == targets[lrows]).float()
        g = grad.float()[lrows] * (hit - torch.exp(z - lse[lrows])) / temperature
        out = torch.zeros(shape, dtype=dtype, device=grad.device)
        out[lrows, lids] = g.to(dtype)
        return out, None, None, None, None, None, None


def kept_logprobs_vocab_parallel(local_logits: torch.Tensor, ids, offsets, targets, *, vocab_start: int,
                                 vocab_size: int, temperature: float = 1.0, group=None) -> torch.Tensor:
    """:func:`~syncd.ops.replay.kept_logprobs` of the full logits ``[T, vocab_size]`` of which this rank holds
    ``local_logits`` ``[T, V_local]`` = columns ``vocab_start ...``. ``ids``/``offsets``/``targets`` are the
    whole (global) kept sets and targets, the same on every rank. Returns float32 ``[T]``, the same on every
    rank; differentiable in ``local_logits`` (the gradient of the kept entries this rank owns).

    Raises ``ValueError`` (on every rank alike) for malformed inputs, a target outside its kept set, or a shard
    that does not fit in ``vocab_size``."""
    if not isinstance(local_logits, torch.Tensor) or local_logits.dim() != 2 or not local_logits.dtype.is_floating_point:
        raise ValueError("kept_logprobs_vocab_parallel: local_logits must be a [T, V_local] floating tensor")
    T, Vp = local_logits.shape
    if not 0 <= vocab_start <= vocab_size - Vp:
        raise ValueError(f"kept_logprobs_vocab_parallel: columns {vocab_start}..{vocab_start + Vp - 1} do not fit "
                         f"in a vocabulary of {vocab_size}")
    ids, offsets, targets = check_csr(T, vocab_size, local_logits.device, ids, offsets, targets, temperature)
    rows = kept_rows(offsets)
    found = torch.zeros(T, dtype=torch.int64, device=ids.device).index_add_(0, rows, (ids == targets[rows]).long())
    if T and bool((found == 0).any()):
        bad = int(torch.nonzero(found == 0)[0])
        raise ValueError(f"kept_logprobs: the target {int(targets[bad])} of row {bad} is not in its kept set")
    return _VocabParallel.apply(local_logits, ids, offsets, targets, int(vocab_start), float(temperature), group)
