"""Committed format-2 test vectors: blobs written before mode 3 existed (today's readers must keep reading them).

The old and new tensors are made from integer hashes only (no RNG, no libm), so they are the same on every
machine and version; the blobs in ``tests/ops/vectors/`` were written from them by the native encoder of the
commit before mode 3 (format 2 then wrote modes 0 and 2; the reference told ``mode=1`` writes mode 1).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent / "vectors"

_MASK = (1 << 64) - 1


def _splitmix(x: np.ndarray) -> np.ndarray:
    x = (x + np.uint64(0x9E3779B97F4A7C15)) & np.uint64(_MASK)
    x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & np.uint64(_MASK)
    x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & np.uint64(_MASK)
    return x ^ (x >> np.uint64(31))


def _key_step(bits: np.ndarray, d: np.ndarray, width: int) -> np.ndarray:
    """``bits`` (float patterns of ``width`` bits) moved by ``d`` units of the order-preserving key."""
    top = np.uint64(1 << (width - 1))
    full = np.uint64((1 << width) - 1)
    b = bits.astype(np.uint64)
    key = np.where(b & top, ~b & full, b | top)
    key = (key.astype(np.int64) + d) & int(full)
    key = key.astype(np.uint64)
    return np.where(key & top, key & ~top, ~key & full)


def weight_like(name: str):
    """(old, new, dtype, block_log2) of a vector: weights of a few binades, changed by 1..3 units of the key
    at rates that differ per block of 2**block_log2 elements (dense, sparse, very sparse), so that a blob has
    blocks of several modes."""
    dtype, n, block_log2, width, exp_lo, exp_bits_shift = {
        "bf16": (torch.bfloat16, 3 * 16384 + 1000, 14, 16, 118, 7),
        "fp32": (torch.float32, 2 * 16384, 14, 32, 118, 23),
    }[name]
    i = np.arange(n, dtype=np.uint64)
    h = _splitmix(i)
    sign = (h >> np.uint64(63)) & np.uint64(1)
    exp = np.uint64(exp_lo) + (h >> np.uint64(40)) % np.uint64(8)
    mant = h & np.uint64((1 << exp_bits_shift) - 1)
    old = (sign << np.uint64(width - 1)) | (exp << np.uint64(exp_bits_shift)) | mant
    g = _splitmix(i ^ np.uint64(0x5DEECE66D))
    block = (i >> np.uint64(block_log2)).astype(np.int64)
    rate = np.array([12, 50, 200, 1000])[np.minimum(block, 3)]  # one change in `rate` elements
    hit = (g % rate.astype(np.uint64)) == 0
    d = ((g >> np.uint64(20)) % np.uint64(3)).astype(np.int64) + 1
    d = np.where((g >> np.uint64(40)) & np.uint64(1), d, -d)
    new = np.where(hit, _key_step(old, d, width), old)
    signed = {16: np.int16, 32: np.int32}[width]

    def tensor(bits):
        return torch.from_numpy(bits.astype({16: np.uint16, 32: np.uint32}[width]).view(signed)).view(dtype)
    return tensor(old), tensor(new), dtype, block_log2


def blob(name: str, mode: int) -> bytes:
    return (HERE / f"{name}_mode{mode}.blob").read_bytes()
