"""Reference of the context that format-2 blocks are modelled on (``docs/delta-format.md``, format 2).

Whether a float weight changes by at least one unit in the last place depends on the size of that unit,
that is on the old value's exponent: measured on real AdamW deltas, the change rate halves with every
binade up. Encoder and decoder both hold the old tensor, so both can sort every element of a block into
one of ``CLASSES`` classes by its old exponent and code each class with its own probabilities.

- ``e_top`` (per block, written in the block): ``class = clamp(e_top - E, 0, CLASSES - 1)`` where ``E`` is the
  old value's exponent field. Integer and bool dtypes have no exponent: every element is class 0.
- The encoder picks ``e_top`` and its probabilities from a fixed sample of the block (elements whose
  block-relative index ``i`` has ``i % SAMPLE_PERIOD < SAMPLE_RUN``), so that every encoder (CPU, GPU,
  reference) writes the same bytes without a histogram of every element. Decoders never look at the sample.
"""

from __future__ import annotations

import numpy as np

from syncd.ops import _format as fmt


def exponent_field(bits: np.ndarray, dtype: fmt.DType) -> np.ndarray:
    """The exponent field of each element's raw bits (int64); zeros for dtypes without one."""
    if not dtype.exp_bits:
        return np.zeros(bits.shape, np.int64)
    return ((bits.astype(np.uint64) >> np.uint64(dtype.exp_shift)) & np.uint64((1 << dtype.exp_bits) - 1)).astype(
        np.int64)


def classes_of(bits: np.ndarray, dtype: fmt.DType, e_top: int) -> np.ndarray:
    """Class (uint8, 0..CLASSES-1) of each element of one block whose old raw bits are ``bits``."""
    if not dtype.exp_bits:
        return np.zeros(bits.shape, np.uint8)
    return np.clip(e_top - exponent_field(bits, dtype), 0, fmt.CLASSES - 1).astype(np.uint8)


def sample_mask(span: int) -> np.ndarray:
    """Which elements of a block of ``span`` elements are in the encoder's statistics sample."""
    return (np.arange(span, dtype=np.int64) % fmt.SAMPLE_PERIOD) < fmt.SAMPLE_RUN


def choose_e_top(bits: np.ndarray, dtype: fmt.DType) -> int:
    """The encoder's ``e_top`` for one block: the largest exponent field among the sampled elements, not
    counting the all-ones field (inf and NaN); 0 when there is none (and for integer dtypes)."""
    if not dtype.exp_bits:
        return 0
    e = exponent_field(bits[sample_mask(bits.size)], dtype)
    e = e[e != (1 << dtype.exp_bits) - 1]
    return int(e.max()) if e.size else 0


def sample_class_counts(classes: np.ndarray) -> np.ndarray:
    """Per class, the number of sampled elements of a block (int64[CLASSES])."""
    return np.bincount(classes[sample_mask(classes.size)], minlength=fmt.CLASSES).astype(np.int64)


def position_probabilities(changed_per_class, sampled_per_class, span: int) -> list[int]:
    """The encoder's change probability of each class, in 1/2**16 (``BIN_PROB_BITS``): 0 for a class without
    changes (its elements are then not coded at all), else the changes over the class's estimated population
    ``sampled * span / sample_size``, rounded to nearest and clamped to 1..65535. Integer arithmetic only."""
    sample_size = int(sum(int(x) for x in sampled_per_class))
    out = []
    for n, s in zip(changed_per_class, sampled_per_class):
        n, s = int(n), max(int(s), 1)
        if n == 0:
            out.append(0)
            continue
        num, den = n * (1 << fmt.BIN_PROB_BITS) * sample_size, s * span
        out.append(min((1 << fmt.BIN_PROB_BITS) - 1, max(1, (2 * num + den) // (2 * den))))
    return out


def continue_probability(more: int, reached: int) -> int:
    """P(a value's bit length goes on past a level | it reached the level), in 1/2**16, from the counts of
    changes that reached the level (``reached`` >= 1) and went past it (``more``); clamped to 1..65535."""
    num, den = more << fmt.BIN_PROB_BITS, reached
    return min((1 << fmt.BIN_PROB_BITS) - 1, max(1, (2 * num + den) // (2 * den)))


def block_context(bits: np.ndarray, dtype: fmt.DType) -> tuple[int, np.ndarray]:
    """What an encoder derives from one block's old bits: its ``e_top`` and the class of every element."""
    e_top = choose_e_top(bits, dtype)
    return e_top, classes_of(bits, dtype, e_top)


def pack_nibbles(classes: np.ndarray) -> np.ndarray:
    """Classes of a whole tensor, two per byte (element ``2i`` in the low nibble of byte ``i``): the form in
    which a GPU hands them to the host codec."""
    c = classes.astype(np.uint8)
    if c.size % 2:
        c = np.concatenate([c, np.zeros(1, np.uint8)])
    return (c[0::2] | (c[1::2] << 4)).astype(np.uint8)


def unpack_nibbles(nibbles: np.ndarray, numel: int) -> np.ndarray:
    """Inverse of ``pack_nibbles``."""
    out = np.empty(2 * nibbles.size, np.uint8)
    out[0::2] = nibbles & 0xF
    out[1::2] = nibbles >> 4
    return out[:numel]
