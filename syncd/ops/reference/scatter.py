"""Reference of ``scatter_words_`` (``syncd/ops/scatter.py``): every check first, then every write, so a failure
leaves every array untouched. NumPy; the native backend (``csrc/cpu/scatter.cpp``) leaves the same words."""

from __future__ import annotations

import numpy as np


def scatter_words(items, verify: bool) -> tuple[int, int] | None:
    """``target[index] = after`` for each ``(target, index, before, after)`` (validated arrays of one word width),
    all or nothing: ``(item, -1)`` for the first item with a position outside its target, ``(item, mismatches)``
    (``verify``) for the first whose words at ``index`` are not all ``before``; else None, every word written."""
    for i, (target, index, before, after) in enumerate(items):
        if index.size and (int(index.min()) < 0 or int(index.max()) >= target.size):
            return i, -1
        if verify:
            bad = int(np.count_nonzero(target[index] != before.view(target.dtype)))
            if bad:
                return i, bad
    for target, index, _, after in items:
        target[index] = after.view(target.dtype)
    return None
