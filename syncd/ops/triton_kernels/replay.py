"""Triton kernels of the replay ops (``syncd/ops/reference/replay.py`` is their specification):

* kept-set log-probabilities, forward (one program per row: an online max / sum of exponentials over the row's
  kept ids, gathered from the logits) and backward (one program per row: scatter into a zeroed gradient);
* route packing and unpacking (``b``-bit fields, LSB first): each program owns whole output bytes (pack) or
  whole ids (unpack), so no two programs write one byte and the result is the reference's, bit for bit;
* the routed gather and its backward scatter (exact).

Divisions are ``div_rn`` (IEEE; Triton's ``/`` is approximate on NVIDIA GPUs). Runs on CUDA tensors, and on CPU
tensors under ``TRITON_INTERPRET=1``. Launchers take contiguous tensors that ``syncd.ops.replay`` validated.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

KEPT_BLOCK = 64
PACK_BLOCK = 1024
GATHER_BLOCK = 1024


@triton.jit
def _kept_forward_kernel(logits_ptr, row_stride, ids_ptr, offsets_ptr, targets_ptr, out_ptr, lse_ptr, zk_ptr,
                         found_ptr, temperature, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lo = tl.load(offsets_ptr + row)
    hi = tl.load(offsets_ptr + row + 1)
    target = tl.load(targets_ptr + row)
    base = logits_ptr + row * row_stride
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    found = tl.zeros((), tl.int32)
    for start in range(lo, hi, BLOCK):
        j = start + tl.arange(0, BLOCK)
        mask = j < hi
        ids = tl.load(ids_ptr + j, mask=mask, other=0)
        z = tl.math.div_rn(tl.load(base + ids, mask=mask, other=0.0).to(tl.float32), temperature)
        tl.store(zk_ptr + j, z, mask=mask)
        z = tl.where(mask, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.where(mask, tl.exp(z - m_new), 0.0), axis=0)
        m = m_new
        found += tl.sum((mask & (ids == target)).to(tl.int32), axis=0)
    lse = m + tl.log(s)
    za = tl.math.div_rn(tl.load(base + target).to(tl.float32), temperature)
    tl.store(out_ptr + row, za - lse)
    tl.store(lse_ptr + row, lse)
    tl.store(found_ptr + row, found)


def kept_forward(logits: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor, targets: torch.Tensor,
                 temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logprob, lse, zk, found)``: float32 per row, float32 per row, the scaled kept logits (float32 per
    kept entry) and int32 per row (kept entries equal to the target)."""
    T = logits.shape[0]
    out = torch.empty(T, dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(out)
    zk = torch.empty(ids.numel(), dtype=torch.float32, device=logits.device)
    found = torch.empty(T, dtype=torch.int32, device=logits.device)
    if T:
        _kept_forward_kernel[(T,)](logits, logits.stride(0), ids, offsets, targets, out, lse, zk, found,
                                   float(temperature), BLOCK=KEPT_BLOCK)
    return out, lse, zk, found


@triton.jit
def _kept_backward_kernel(grad_ptr, zk_ptr, ids_ptr, offsets_ptr, targets_ptr, lse_ptr, out_ptr, vocab, temperature,
                          BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lo = tl.load(offsets_ptr + row)
    hi = tl.load(offsets_ptr + row + 1)
    target = tl.load(targets_ptr + row)
    g = tl.load(grad_ptr + row)
    lse = tl.load(lse_ptr + row)
    for start in range(lo, hi, BLOCK):
        j = start + tl.arange(0, BLOCK)
        mask = j < hi
        ids = tl.load(ids_ptr + j, mask=mask, other=0)
        z = tl.load(zk_ptr + j, mask=mask, other=0.0)
        hit = (ids == target).to(tl.float32)
        val = tl.math.div_rn(g * (hit - tl.exp(z - lse)), temperature)
        tl.store(out_ptr + row * vocab + ids, val.to(out_ptr.dtype.element_ty), mask=mask)


def kept_backward(grad: torch.Tensor, zk: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor,
                  targets: torch.Tensor, lse: torch.Tensor, temperature: float, shape, dtype) -> torch.Tensor:
    T, V = shape
    out = torch.zeros((T, V), dtype=dtype, device=grad.device)
    if T:
        _kept_backward_kernel[(T,)](grad, zk, ids, offsets, targets, lse, out, V, float(temperature),
                                    BLOCK=KEPT_BLOCK)
    return out


@triton.jit
def _pack_kernel(ids_ptr, n_ids, out_ptr, n_bytes, B: tl.constexpr, BLOCK: tl.constexpr):
    byte = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = byte < n_bytes
    acc = tl.zeros((BLOCK,), tl.int32)
    for t in tl.static_range(8):
        bit = byte * 8 + t
        i = bit // B
        ok = live & (i < n_ids)
        v = tl.load(ids_ptr + i, mask=ok, other=0)
        acc |= (((v >> (bit % B)) & 1).to(tl.int32) << t) * ok.to(tl.int32)
    tl.store(out_ptr + byte, acc.to(tl.uint8), mask=live)


def pack_routes(ids: torch.Tensor, bits: int) -> torch.Tensor:
    n = ids.numel()
    n_bytes = (n * bits + 7) // 8
    out = torch.empty(n_bytes, dtype=torch.uint8, device=ids.device)
    if n_bytes:
        _pack_kernel[(triton.cdiv(n_bytes, PACK_BLOCK),)](ids.reshape(-1), n, out, n_bytes, B=bits, BLOCK=PACK_BLOCK)
    return out


@triton.jit
def _unpack_kernel(packed_ptr, n_ids, out_ptr, B: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = i < n_ids
    acc = tl.zeros((BLOCK,), tl.int64)
    for t in tl.static_range(B):
        bit = i * B + t
        byte = tl.load(packed_ptr + bit // 8, mask=live, other=0).to(tl.int64)
        acc |= ((byte >> (bit % 8)) & 1) << t
    tl.store(out_ptr + i, acc, mask=live)


def unpack_routes(packed: torch.Tensor, count: int, bits: int) -> torch.Tensor:
    out = torch.empty(count, dtype=torch.int64, device=packed.device)
    if count:
        _unpack_kernel[(triton.cdiv(count, PACK_BLOCK),)](packed, count, out, B=bits, BLOCK=PACK_BLOCK)
    return out


@triton.jit
def _routed(routes_ptr, n, k, E, BLOCK: tl.constexpr):
    # this program's block of the n*k (token, slot) places: the places, which exist, which name an expert
    # (route >= 0), and where that expert sits in a row-major [n, E] tensor
    p = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = p < n * k
    r = tl.load(routes_ptr + p, mask=live, other=-1).to(tl.int64)
    return p, live, live & (r >= 0), (p // k) * E + r


@triton.jit
def _gather_kernel(probs_ptr, routes_ptr, out_ptr, n, k, E, BLOCK: tl.constexpr):
    p, live, valid, at = _routed(routes_ptr, n, k, E, BLOCK)
    v = tl.load(probs_ptr + at, mask=valid, other=0.0)
    tl.store(out_ptr + p, tl.where(valid, v, 0.0), mask=live)


@triton.jit
def _scatter_kernel(grad_ptr, routes_ptr, out_ptr, n, k, E, BLOCK: tl.constexpr):
    p, live, valid, at = _routed(routes_ptr, n, k, E, BLOCK)
    g = tl.load(grad_ptr + p, mask=valid, other=0.0)
    tl.store(out_ptr + at, g, mask=valid)


def _launch_routed(kernel, src: torch.Tensor, routes: torch.Tensor, out: torch.Tensor, num_experts: int):
    n, k = routes.shape
    if n * k:
        kernel[(triton.cdiv(n * k, GATHER_BLOCK),)](src, routes, out, n, k, num_experts, BLOCK=GATHER_BLOCK)
    return out


def gather_routed(probs: torch.Tensor, routes: torch.Tensor) -> torch.Tensor:
    out = torch.empty(routes.shape, dtype=probs.dtype, device=probs.device)
    return _launch_routed(_gather_kernel, probs, routes, out, probs.shape[1])


def gather_routed_backward(grad: torch.Tensor, routes: torch.Tensor, num_experts: int) -> torch.Tensor:
    out = torch.zeros((routes.shape[0], num_experts), dtype=grad.dtype, device=grad.device)
    return _launch_routed(_scatter_kernel, grad, routes, out, num_experts)
