"""Helpers shared by the op tests: tensors with realistic and adversarial bit patterns."""

from __future__ import annotations

import struct

import numpy as np
import torch

from syncd.ops import _format as fmt
from syncd.ops.reference import checksum as ck

TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU runs under TRITON_INTERPRET=1


def on(t: torch.Tensor, backend: str) -> torch.Tensor:
    """``t`` on the device a backend runs on in this test session."""
    if backend == "triton":
        return t.to(TRITON_DEVICE)
    if backend == "cuda":
        return t.cuda()
    return t


ALL_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8,
              torch.int8, torch.int16, torch.int32, torch.float64, torch.int64, torch.bool]
ISSUE_DTYPES = ALL_DTYPES[:9]

_BITS_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def random_bits(shape, dtype, gen: torch.Generator) -> torch.Tensor:
    """A tensor of ``dtype`` whose bytes are uniformly random (every NaN payload, inf, subnormal, -0.0...)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = int(np.prod(shape)) if len(shape) else 1
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw &= 1
    return raw.view(dtype).reshape(shape)


def perturb(old: torch.Tensor, density: float, gen: torch.Generator, max_step: int = 3) -> torch.Tensor:
    """``old`` with a ``density`` fraction of elements moved by 1..max_step units of their integer bits, in
    either direction (wrapping): for floats, a few ulps, crossing zero, inf and NaN boundaries too."""
    itemsize = old.element_size()
    bits = old.reshape(-1).view(_BITS_VIEW[itemsize]).clone()
    n = bits.numel()
    mask = torch.rand(n, generator=gen) < density
    steps = torch.randint(1, max_step + 1, (n,), generator=gen) * (torch.randint(0, 2, (n,), generator=gen) * 2 - 1)
    if old.dtype == torch.bool:
        out = bits ^ mask.to(torch.uint8)
        return out.view(torch.bool).reshape(old.shape)
    moved = (bits.to(torch.int64) + steps).to(bits.dtype)
    bits[mask] = moved[mask]
    return bits.view(old.dtype).reshape(old.shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.detach().cpu().contiguous().reshape(-1).view(torch.uint8), b.detach().cpu().contiguous().reshape(-1).view(torch.uint8))


def reseal(blob: bytes) -> bytes:
    """Recompute every payload checksum and the header checksum of a (possibly mutated) blob, so that the
    decoder's structural checks, not the checksums, are what a test exercises. Needs a parseable fixed header."""
    b = bytearray(blob)
    (_, _, _, ndim, _, _, n_blocks, *_rest) = fmt.HEADER_FIXED.unpack_from(b, 0)
    hsize = fmt.header_size(ndim, n_blocks)
    off = fmt.HEADER_FIXED.size + 8 * ndim
    at = hsize
    for i in range(n_blocks):
        e = off + i * fmt.BLOCK_ENTRY.size
        plen, nchg, _ = fmt.BLOCK_ENTRY.unpack_from(b, e)
        payload = bytes(b[at : at + plen])
        fmt.BLOCK_ENTRY.pack_into(b, e, plen, nchg, ck.checksum_bytes(payload) if payload else 0)
        at += plen
    struct.pack_into("<Q", b, hsize - 8, ck.checksum_bytes(bytes(b[: hsize - 8])))
    return bytes(b)
