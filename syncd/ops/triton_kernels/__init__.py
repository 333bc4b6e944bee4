"""Triton kernels for the GPU parts of the delta codec: content checksum, changed-word scan with compaction,
and in-place apply. Entropy coding stays on the CPU (only the compact change list crosses PCIe).

Runs on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (how CI tests it). Launch-level
functions take torch tensors; they are not thread-safe with respect to the same output tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from syncd.ops import _checksum_math as ck
from syncd.ops._tensors import int_view

_UINT = {8: tl.uint8, 16: tl.uint16, 32: tl.uint32, 64: tl.uint64}

CHECKSUM_BLOCK = 1024
SCAN_BLOCK = 1024


@triton.jit
def _fmix64(x):
    x = x ^ (x >> 33)
    x = x * 0xFF51AFD7ED558CCD
    x = x ^ (x >> 33)
    x = x * 0xC4CEB9FE1A85EC53
    return x ^ (x >> 33)


@triton.jit
def _word_mix(x):
    y = (x ^ (x >> 32)) * 0xD6E8FEB86659FD93
    return y ^ (y >> 32)


@triton.jit
def _checksum_kernel(words_ptr, n_words, partial_ptr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    idx = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n_words
    w = tl.load(words_ptr + idx, mask=mask, other=0).to(tl.uint64, bitcast=True)
    k = (idx.to(tl.uint64) + 1) * 0x9E3779B97F4A7C15
    t = _word_mix(w ^ k)
    t = tl.where(mask, t, 0)
    tl.store(partial_ptr + pid, tl.sum(t, axis=0).to(tl.int64, bitcast=True))


def checksum_raw(t: torch.Tensor) -> tuple[int, int]:
    """(raw, nbytes) of a contiguous tensor's bytes; the whole words on the device, the tail on the host."""
    b = t.detach().reshape(-1).view(torch.uint8)
    if b.storage_offset() % 8:  # a byte view into a buffer: the word view needs 8-byte alignment
        b = b.clone()
    nbytes = b.numel()
    whole = nbytes // 8
    raw = 0
    if whole:
        words = b[: whole * 8].view(torch.int64)
        grid = triton.cdiv(whole, CHECKSUM_BLOCK)
        partial = torch.empty(grid, dtype=torch.int64, device=t.device)
        _checksum_kernel[(grid,)](words, whole, partial, BLOCK=CHECKSUM_BLOCK)
        raw = int(partial.sum().item()) & ck.MASK64
    if nbytes % 8:
        raw = (raw + ck.raw_sum(b[whole * 8 :].cpu().numpy(), first_word=whole)) & ck.MASK64
    return raw, nbytes


def checksum(t: torch.Tensor) -> int:
    raw, nbytes = checksum_raw(t)
    return ck.finalize(raw, nbytes)


@triton.jit
def _flip(x, negative, W: tl.constexpr):
    # the order-preserving map of W-bit float patterns, both ways: all bits flipped where ``negative``, else the top bit
    allones = (1 << W) - 1 if W < 64 else 0xFFFFFFFFFFFFFFFF
    return tl.where(negative, (~x) & allones, x ^ (1 << (W - 1)))


@triton.jit
def _key(b, W: tl.constexpr, IS_FLOAT: tl.constexpr):
    # b: uint64 holding a W-bit pattern; a float's sign bit set: negative
    if IS_FLOAT:
        return _flip(b, ((b >> (W - 1)) & 1) != 0, W)
    else:
        return b


@triton.jit
def _unkey(k, W: tl.constexpr, IS_FLOAT: tl.constexpr):
    # the inverse of _key: a key's top bit clear came from a negative float
    if IS_FLOAT:
        return _flip(k, ((k >> (W - 1)) & 1) == 0, W)
    else:
        return k


@triton.jit
def _load_bits(ptr, idx, mask, W: tl.constexpr, UT: tl.constexpr):
    return tl.load(ptr + idx, mask=mask, other=0).to(UT, bitcast=True).to(tl.uint64)


@triton.jit
def _count_kernel(old_ptr, new_ptr, n, count_ptr, W: tl.constexpr, UT: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    idx = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    a = _load_bits(old_ptr, idx, mask, W, UT)
    b = _load_bits(new_ptr, idx, mask, W, UT)
    tl.store(count_ptr + pid, tl.sum((a != b).to(tl.int32), axis=0))


@triton.jit
def _compact_kernel(old_ptr, new_ptr, n, offset_ptr, pos_ptr, v_ptr, W: tl.constexpr, UT: tl.constexpr,
                    IS_FLOAT: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    idx = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    a = _load_bits(old_ptr, idx, mask, W, UT)
    b = _load_bits(new_ptr, idx, mask, W, UT)
    changed = (a != b) & mask
    c = changed.to(tl.int32)
    slot = tl.load(offset_ptr + pid) + tl.cumsum(c, axis=0) - c
    wmask = (1 << W) - 1 if W < 64 else 0xFFFFFFFFFFFFFFFF
    d = (_key(b, W, IS_FLOAT) - _key(a, W, IS_FLOAT)) & wmask
    neg = (d >> (W - 1)) & 1
    u = ((d << 1) & wmask) ^ ((0 - neg) & wmask)
    v = u - 1
    tl.store(pos_ptr + slot, idx, mask=changed)
    tl.store(v_ptr + slot, v.to(tl.int64, bitcast=True), mask=changed)


def _bits(t: torch.Tensor, bits: int) -> torch.Tensor:
    return int_view(t.detach().reshape(-1))


def find_changes(old: torch.Tensor, new: torch.Tensor, bits: int, is_float: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions (int64, ascending) and coded values ``v`` (uint64 bits in an int64 tensor) of the elements
    that differ, on the tensors' device. Same contract as ``reference.delta.changes``."""
    a, b = _bits(old, bits), _bits(new, bits)
    n = a.numel()
    grid = max(1, triton.cdiv(n, SCAN_BLOCK))
    counts = torch.zeros(grid, dtype=torch.int32, device=a.device)
    if n:
        _count_kernel[(grid,)](a, b, n, counts, W=bits, UT=_UINT[bits], BLOCK=SCAN_BLOCK)
    offsets = torch.cumsum(counts, 0, dtype=torch.int64)
    total = int(offsets[-1].item()) if n else 0
    offsets = offsets - counts
    pos = torch.empty(total, dtype=torch.int64, device=a.device)
    v = torch.empty(total, dtype=torch.int64, device=a.device)
    if total:
        _compact_kernel[(grid,)](a, b, n, offsets, pos, v, W=bits, UT=_UINT[bits], IS_FLOAT=is_float,
                                 BLOCK=SCAN_BLOCK)
    return pos, v


@triton.jit
def _scatter_kernel(t_ptr, pos_ptr, v_ptr, m, W: tl.constexpr, UT: tl.constexpr, IS_FLOAT: tl.constexpr,
                    FORWARD: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    j = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = j < m
    p = tl.load(pos_ptr + j, mask=mask, other=0)
    v = tl.load(v_ptr + j, mask=mask, other=0).to(tl.uint64, bitcast=True)
    old = tl.load(t_ptr + p, mask=mask, other=0)
    wmask = (1 << W) - 1 if W < 64 else 0xFFFFFFFFFFFFFFFF
    u = v + 1
    d = ((u >> 1) ^ (0 - (u & 1))) & wmask
    k = _key(old.to(UT, bitcast=True).to(tl.uint64), W, IS_FLOAT)
    if FORWARD:
        k = (k + d) & wmask
    else:
        k = (k - d) & wmask
    new = _unkey(k, W, IS_FLOAT).to(UT).to(old.dtype, bitcast=True)
    tl.store(t_ptr + p, new, mask=mask)


def scatter_apply(target: torch.Tensor, pos: torch.Tensor, v: torch.Tensor, bits: int, is_float: bool,
                  forward: bool = True) -> None:
    """Apply coded values at positions in place (``forward=False`` undoes it exactly). ``target`` must be
    contiguous; ``pos``/``v`` int64 tensors on its device."""
    m = pos.numel()
    if not m:
        return
    t = int_view(target.view(-1) if target.dim() else target.view(1))
    grid = triton.cdiv(m, SCAN_BLOCK)
    _scatter_kernel[(grid,)](t, pos, v, m, W=bits, UT=_UINT[bits], IS_FLOAT=is_float, FORWARD=forward,
                             BLOCK=SCAN_BLOCK)
