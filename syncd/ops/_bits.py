"""The coded change of one element (``docs/delta-format.md``): every backend's decoder turns an old element's
raw bits and its coded value ``v = zigzag(key delta) - 1`` into the new bits here, and the reference encoder
(``syncd/ops/reference/delta.py``, ``changes``) finds ``v`` with the same key. NumPy arrays of raw element bits
(``dtype.np_uint``); pure functions.
"""

from __future__ import annotations

import numpy as np

from syncd.ops import _format as fmt


def to_key(bits: np.ndarray, dtype: fmt.DType) -> np.ndarray:
    """Order-preserving unsigned key of raw element bits: for floats, a negative (sign set) flips every bit
    and a positive flips the sign bit, so adjacent floats have adjacent keys and -0.0/+0.0 differ by one.
    Integers are keyed by their bits (differences are taken modulo 2**bits)."""
    if not dtype.is_float:
        return bits
    u = dtype.np_uint
    sign = u(1 << (dtype.bits - 1))
    neg = (bits & sign) != 0
    return np.where(neg, ~bits, bits | sign).astype(u)


def from_key(key: np.ndarray, dtype: fmt.DType) -> np.ndarray:
    """Inverse of :func:`to_key`."""
    if not dtype.is_float:
        return key
    u = dtype.np_uint
    sign = u(1 << (dtype.bits - 1))
    pos = (key & sign) != 0
    return np.where(pos, key ^ sign, ~key).astype(u)


def apply_values(old_bits: np.ndarray, v: np.ndarray, dtype: fmt.DType) -> np.ndarray:
    """New element bits from old bits and coded values ``v`` (uint64, one per element)."""
    w = dtype.bits
    mask = np.uint64((1 << w) - 1)
    u = v.astype(np.uint64) + np.uint64(1)
    d = (u >> np.uint64(1)) ^ (np.uint64(0) - (u & np.uint64(1)))
    key = (to_key(old_bits, dtype).astype(np.uint64) + d) & mask
    return from_key(key.astype(dtype.np_uint), dtype)
