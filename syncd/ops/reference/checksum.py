"""Reference of the 64-bit content checksum (format in ``docs/delta-format.md``).

The checksum of a byte string ``b`` of length ``n``: pad ``b`` with zero bytes to a multiple of 8, read it as
little-endian u64 words ``w_i`` (i from 0), then

    raw      = sum_i mix(w_i XOR ((i + 1) * GOLDEN))           (mod 2**64)
    mix(x)   = y XOR (y >> 32)  with  y = (x XOR (x >> 32)) * WORD_MUL   (mod 2**64)
    checksum = fmix64(raw + n * LENGTH_MUL)                    (mod 2**64)

where ``fmix64`` is MurmurHash3's 64-bit finaliser. ``mix`` is a bijection (one multiply between two
xor-shifts; the first folds the high half down so that every input bit reaches the multiply's carries), so
a change to any single word always changes the sum; it is cheap enough that a full pass runs at memory speed. The sum
makes it parallel (any split of the words, any order, on any device) and incremental: changing word ``i``
from ``a`` to ``b`` changes ``raw`` by ``mix(b ^ k_i) - mix(a ^ k_i)``, which lets a decoder check the result
of an update from the changed words alone.
It detects corruption; it is not a cryptographic hash (manifests are signed separately).

The arithmetic (``mix``, the raw sum, ``fmix64`` and its inverse) is ``syncd/ops/_checksum_math.py``, which
every backend shares; this module states the checksum of a byte string with it.
"""

from __future__ import annotations

import numpy as np

from syncd.ops._checksum_math import finalize, raw_sum


def checksum_bytes(data) -> int:
    """Checksum of a bytes-like object or array."""
    arr = np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) else data
    arr = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    return finalize(raw_sum(arr), arr.size)
