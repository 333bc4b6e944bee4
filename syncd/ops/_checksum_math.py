"""The arithmetic of the 64-bit content checksum on the host (the definition: ``syncd/ops/reference/checksum.py``
and ``docs/delta-format.md``): the word mix and per-word key, the raw sum over a NumPy array, the finaliser, its
inverse, and the update of a raw sum when some words change.

Every backend shares it: the GPU backends sum the whole words on the device and finish here, the incremental
check of ``delta.changed_words`` runs on it, and the reference states the checksum of a byte string with it.
Integers are Python ints in ``[0, 2**64)``; arrays are uint64 with wrapping arithmetic. Pure functions.
"""

from __future__ import annotations

import numpy as np

GOLDEN = 0x9E3779B97F4A7C15
LENGTH_MUL = 0xC2B2AE3D27D4EB4F
WORD_MUL = 0xD6E8FEB86659FD93
FMIX_C1 = 0xFF51AFD7ED558CCD
FMIX_C2 = 0xC4CEB9FE1A85EC53
MASK64 = (1 << 64) - 1
_FMIX_C1_INV = pow(FMIX_C1, -1, 1 << 64)
_FMIX_C2_INV = pow(FMIX_C2, -1, 1 << 64)
_CHUNK_WORDS = 1 << 20


def word_mix(x: np.ndarray) -> np.ndarray:
    """``mix`` on a uint64 array (wrapping arithmetic)."""
    y = (x ^ (x >> np.uint64(32))) * np.uint64(WORD_MUL)
    return y ^ (y >> np.uint64(32))


def word_mix_int(x: int) -> int:
    y = ((x ^ (x >> 32)) * WORD_MUL) & MASK64
    return y ^ (y >> 32)


def fmix64_int(x: int) -> int:
    """MurmurHash3's 64-bit finaliser ``fmix64``."""
    x &= MASK64
    x ^= x >> 33
    x = (x * FMIX_C1) & MASK64
    x ^= x >> 33
    x = (x * FMIX_C2) & MASK64
    return x ^ (x >> 33)


def word_key(index: np.ndarray) -> np.ndarray:
    """The per-word key ``(i + 1) * GOLDEN`` for word indices ``index`` (uint64)."""
    return (index.astype(np.uint64) + np.uint64(1)) * np.uint64(GOLDEN)


def raw_sum(data: np.ndarray, first_word: int = 0) -> int:
    """``raw`` of the checksum over ``data`` (any contiguous array, read as bytes), as if its first word
    had index ``first_word``."""
    b = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    n = b.size
    pad = (-n) % 8
    if pad:
        b = np.concatenate([b, np.zeros(pad, np.uint8)])
    words = b.view("<u8")
    total = 0
    with np.errstate(over="ignore"):
        for start in range(0, words.size, _CHUNK_WORDS):
            w = words[start : start + _CHUNK_WORDS].astype(np.uint64)
            k = word_key(np.arange(first_word + start, first_word + start + w.size, dtype=np.uint64))
            total = (total + int(word_mix(w ^ k).sum(dtype=np.uint64))) & MASK64
    return total


def finalize(raw: int, nbytes: int) -> int:
    """The checksum of ``nbytes`` bytes whose raw sum is ``raw``: ``fmix64(raw + nbytes * LENGTH_MUL)``."""
    return fmix64_int((raw + nbytes * LENGTH_MUL) & MASK64)


def raw_of(checksum: int, nbytes: int) -> int:
    """``raw`` of a checksum over ``nbytes`` bytes (``finalize`` inverted: fmix64 is a bijection, each of its
    xor-shifts by 33 is its own inverse and each multiply is undone by the constant's inverse mod 2**64)."""
    x = checksum & MASK64
    x ^= x >> 33
    x = (x * _FMIX_C2_INV) & MASK64
    x ^= x >> 33
    x = (x * _FMIX_C1_INV) & MASK64
    x ^= x >> 33
    return (x - nbytes * LENGTH_MUL) & MASK64


def raw_after(raw: int, index: np.ndarray, old_words: np.ndarray, new_words: np.ndarray) -> int:
    """``raw`` after the words at ``index`` (word indices) change from ``old_words`` to ``new_words`` (uint64
    arrays of one length; each index at most once): adds ``mix(new ^ k_i) - mix(old ^ k_i)`` per word."""
    k = word_key(np.asarray(index))
    with np.errstate(over="ignore"):
        up = int(word_mix(np.asarray(new_words, np.uint64) ^ k).sum(dtype=np.uint64))
        down = int(word_mix(np.asarray(old_words, np.uint64) ^ k).sum(dtype=np.uint64))
    return (raw + up - down) & MASK64
