"""``scatter_words_``: write staged words into many word arrays at once, all or nothing, each word compared just
before it is written -- what an engine's in-place apply and rollback do (``syncd.engine.WeightUpdater``).

Backends: ``cpu`` (native, ``csrc/cpu/scatter.cpp``: every array cut into runs of 8192 words written on every
core while their cache lines are hot; a failure undoes every run already written) and ``reference``
(``syncd/ops/reference/scatter.py``, NumPy: every check first, then every write). Both leave the same words for
every input, and the same arrays untouched on a failure. Thread-safety: calls are independent; don't scatter into
one array from two threads.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from syncd.ops import _backend
from syncd.ops._dispatch import dispatch, kernel

__all__ = ["scatter_words_"]

_RUN = 1 << 13  # words compared and then written while their cache lines are hot
_PARALLEL_MIN = 1 << 17  # fewer words in all than this are written by the calling thread


def scatter_words_(items: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]], *, verify: bool = True,
                   backend: str = "auto") -> tuple[int, int] | None:
    """For each ``(target, index, before, after)``: ``target[index] = after``, in place.

    ``target`` is a 1-D array of 1-, 2-, 4- or 8-byte words (a strided view is fine, e.g. the bf16 halves of
    fp32 weights); ``index`` int64 positions into it; ``before`` and ``after`` words of ``target``'s width, one
    per position. With ``verify`` each position must hold its ``before`` word when it is written. All or
    nothing across every item: on a position outside its target, or (``verify``) a word that is not its
    ``before``, nothing is left written and ``(item, mismatches)`` is returned -- the first failing item and how
    many of its words differ (at least one; ``-1``: a position is outside the target). Returns None when every
    word was written. Raises ``ValueError`` for arrays of different widths, lengths or an unsupported stride,
    ``BackendUnavailable``. The arrays must stay alive during the call."""
    for target, index, before, after in items:
        w = target.itemsize
        if target.ndim != 1 or w not in (1, 2, 4, 8) or before.itemsize != w or after.itemsize != w:
            raise ValueError(f"scatter_words_: target, before and after must be 1-D arrays of one word width "
                             f"(1, 2, 4 or 8 bytes); got {target.dtype}, {before.dtype}, {after.dtype}")
        if index.dtype != np.int64 or not (index.size == before.size == after.size):
            raise ValueError("scatter_words_: index must be int64, with as many before and after words")
    return dispatch("scatter_words", backend, "cpu")(items, verify)


@kernel("scatter_words", "cpu")
def _scatter_cpu(items, verify: bool):
    runs, owners, keep = [], [], []  # ``keep``: the arrays the runs point into, alive until the call returns
    for i, (target, index, before, after) in enumerate(items):
        index, before, after = (np.ascontiguousarray(a) for a in (index, before, after))
        keep += (index, before, after)
        w = target.itemsize
        for lo in range(0, index.size, _RUN):
            runs.append((target.ctypes.data, target.size, target.strides[0], index.ctypes.data + 8 * lo,
                         before.ctypes.data + w * lo, after.ctypes.data + w * lo, min(_RUN, index.size - lo), w))
            owners.append(i)
    if not runs:
        return None
    threads = max(1, _backend.threads()) if sum(r[6] for r in runs) >= _PARALLEL_MIN else 1
    failed, bad = _backend.native().scatter_runs_ptr(runs, verify, threads)
    return None if failed < 0 else (owners[failed], bad)
