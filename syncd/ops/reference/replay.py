"""Plain-PyTorch reference of the replay ops (the specification every backend is tested against).

* **kept-set log-probabilities**: row ``t`` of ``logits`` ``[T, V]`` has a kept set ``ids[offsets[t]:offsets[t+1]]``
  (CSR, ascending ids, at least one) and a target ``a = targets[t]`` inside it; with ``z = logits[t] /
  temperature`` (float32) the result is ``z[a] - logsumexp(z[kept])``. Only the kept entries are read; nothing
  of size ``[T, V]`` is built (autograd's gradient of ``logits`` is the one ``[T, V]`` tensor, and it is zero off
  the kept entries).
* **route packing**: expert ids in ``[0, E)`` as ``b = max(1, ceil(log2 E))``-bit fields, LSB first, in row-major
  order; padding bits are 0 (the bit layout of ``docs/replay-format.md``'s routing payload).
* **routed gather**: ``out[n, j] = probs[n, routes[n, j]]``, and 0 where ``routes[n, j] < 0`` (no route: a padding
  position). Exact, so every backend gives the same bits.
"""

from __future__ import annotations

import torch

__all__ = ["kept_rows", "kept_logprobs", "kept_logprobs_backward", "bits_per_id", "pack_routes", "unpack_routes",
           "gather_routed", "gather_routed_backward"]


def kept_rows(offsets: torch.Tensor) -> torch.Tensor:
    """The row of every kept entry (int64, ``[offsets[-1]]``)."""
    sizes = (offsets[1:] - offsets[:-1]).to(torch.int64)
    return torch.repeat_interleave(torch.arange(sizes.numel(), device=offsets.device), sizes)


def kept_logprobs(logits: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor, targets: torch.Tensor,
                  temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logprob [T], lse [T], zk [K])`` float32 (``zk``: the scaled kept logits, what the backward reads);
    differentiable in ``logits`` through PyTorch autograd."""
    T = logits.shape[0]
    rows = kept_rows(offsets)
    ids = ids.to(torch.int64)
    z = logits[rows, ids].float() / temperature
    m = torch.full((T,), float("-inf"), device=logits.device).scatter_reduce(0, rows, z.detach(), "amax")
    s = torch.zeros(T, device=logits.device).index_add(0, rows, torch.exp(z - m[rows]))
    lse = m + torch.log(s)
    za = logits[torch.arange(T, device=logits.device), targets.to(torch.int64)].float() / temperature
    return za - lse, lse, z


def kept_logprobs_backward(grad: torch.Tensor, zk: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor,
                           targets: torch.Tensor, lse: torch.Tensor, temperature: float, shape, dtype) -> torch.Tensor:
    """d(sum grad * logprob)/d logits (``shape`` ``[T, V]``, ``dtype``): ``grad[t] * ((id == a) -
    exp(zk - lse[t])) / temperature`` at the kept entries, 0 elsewhere."""
    rows = kept_rows(offsets)
    ids = ids.to(torch.int64)
    p = torch.exp(zk - lse[rows])
    hit = (ids == targets.to(torch.int64)[rows]).float()
    g = grad.float()[rows] * (hit - p) / temperature
    out = torch.zeros(tuple(shape), dtype=dtype, device=grad.device)
    out[rows, ids] = g.to(dtype)
    return out


def bits_per_id(num_experts: int) -> int:
    """Bits of one expert id: ``max(1, ceil(log2 num_experts))``."""
    return max(1, (int(num_experts) - 1).bit_length())


def pack_routes(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """uint8 ``[ceil(n * b / 8)]`` of the ``n`` ids (flattened row-major; each in ``[0, num_experts)``)."""
    b = bits_per_id(num_experts)
    flat = ids.reshape(-1).to(torch.int64)
    shifts = torch.arange(b, device=flat.device)
    bits = ((flat[:, None] >> shifts) & 1).reshape(-1)
    nbytes = (bits.numel() + 7) // 8
    bits = torch.cat([bits, bits.new_zeros(nbytes * 8 - bits.numel())]).view(nbytes, 8)
    weights = (1 << torch.arange(8, device=flat.device))
    return (bits * weights).sum(1).to(torch.uint8)


def unpack_routes(packed: torch.Tensor, count: int, num_experts: int) -> tuple[torch.Tensor, bool]:
    """``(ids int64 [count], padding_clean)`` of :func:`pack_routes` bytes; ``padding_clean`` is False when a
    bit past the last id is set. Ids are not range-checked here (the op surface does)."""
    b = bits_per_id(num_experts)
    raw = packed.reshape(-1).to(torch.int64)
    bits = ((raw[:, None] >> torch.arange(8, device=raw.device)) & 1).reshape(-1)
    used = count * b
    clean = not bool(bits[used:].any())
    vals = (bits[:used].view(count, b) << torch.arange(b, device=raw.device)).sum(1) if count else \
        torch.zeros(0, dtype=torch.int64, device=raw.device)
    return vals, clean


def gather_routed(probs: torch.Tensor, routes: torch.Tensor) -> torch.Tensor:
    """``[N, k]`` in ``probs``' dtype: ``probs[n, routes[n, j]]``, 0 where ``routes[n, j] < 0``."""
    valid = routes >= 0
    idx = torch.where(valid, routes, torch.zeros_like(routes)).to(torch.int64)
    g = probs.gather(1, idx)
    return torch.where(valid, g, torch.zeros_like(g))


def gather_routed_backward(grad: torch.Tensor, routes: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[N, E]``: ``grad[n, j]`` at ``[n, routes[n, j]]`` (routes of a row are distinct), 0 elsewhere."""
    valid = routes >= 0
    idx = torch.where(valid, routes, torch.zeros_like(routes)).to(torch.int64)
    out = torch.zeros((routes.shape[0], num_experts), dtype=grad.dtype, device=grad.device)
    return out.scatter_add_(1, idx, torch.where(valid, grad, torch.zeros_like(grad)))
