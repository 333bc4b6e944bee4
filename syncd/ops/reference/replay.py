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
* **kept sets** (what top-k/top-p sampling may draw from; one row at a time, the sampler's own algorithm): rank the
  scaled logits ``z = logits / temperature`` (float32; the raw logits when greedy) in descending order, ties by
  the lower id; keep the first ``top_k`` (when ``0 < top_k < V``), then the smallest prefix whose renormalised mass
  reaches ``top_p`` (at least one id); greedy (``temperature == 0``) keeps the first; a given ``size`` keeps the
  first ``size``. ``gaps[j] = z[rank j] - z[rank j + 1]`` (``inf`` past the vocabulary): the margin that decides
  whether the first ``j + 1`` ids stay the first ``j + 1`` under a perturbation of the logits.
* **kept-set fingerprint**: ``sum(mix32(id ^ 0x9E3779B9) for id in set) mod 2**32``, ``mix32`` the bijective
  "lowbias32" integer hash (C. Wellons): independent of order; two sets that differ by one id never collide.

The layout helpers (a CSR entry's row, an expert id's width, the fingerprint's salt) are
``syncd/ops/_replay_layout.py``.
"""

from __future__ import annotations

import torch

from syncd.ops._replay_layout import FINGERPRINT_SALT, bits_per_id, kept_rows

__all__ = ["kept_logprobs", "kept_logprobs_backward", "pack_routes", "unpack_routes", "gather_routed",
           "gather_routed_backward", "kept_set_row", "kept_fingerprint"]


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


def kept_set_row(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                 size: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids, values, gaps, logprobs)`` of one row ``logits`` ``[V]``: the kept ids in rank order (int64), their
    scaled logits and gaps (float32), and their log-probabilities renormalised over the kept set (float32;
    0 for greedy)."""
    x = logits.float()
    z = x if temperature == 0 else x / temperature
    order = torch.sort(z, descending=True, stable=True)
    vals, ids = order.values, order.indices
    V = z.numel()
    if size is not None:
        n = int(size)
    elif temperature == 0:
        n = 1
    else:
        n = top_k if 0 < top_k < V else V
        if top_p < 1.0:
            cum = torch.cumsum(torch.log_softmax(vals[:n], dim=0).exp(), dim=0)
            # smallest prefix whose mass reaches top_p (at least one token)
            at = int(torch.searchsorted(cum, torch.tensor([top_p], dtype=cum.dtype, device=cum.device))[0])
            n = max(1, min(at + 1, n))
    after = torch.cat([vals[1:n + 1], vals.new_full((max(0, n + 1 - V),), float("-inf"))])
    return ids[:n], vals[:n], vals[:n] - after, torch.log_softmax(vals[:n], dim=0)


def _mix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def kept_fingerprint(ids) -> int:
    """The 32-bit fingerprint of one kept set (any order; ids below ``2**32``)."""
    return sum(_mix32(int(i) ^ FINGERPRINT_SALT) for i in ids) & 0xFFFFFFFF
