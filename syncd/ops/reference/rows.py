"""Reference of format 2's mode-3 positions, coded by row flags (``docs/delta-format.md``, format 2): the spec.

Modes 1 and 2 code one yes/no decision per element of a coded class. At about 1% changed words most rows of 16
elements have no change at all, and mode 3 codes each of those with one decision:

- **Row context** of row ``t`` (elements ``16t .. 16t + 15`` of the block): the largest class among its
  elements (the class of its smallest exponent).
- **Flags**: whether row ``t`` has a change, with the probability ``pa[ctx]`` of its context, which the block
  lists for the contexts that have a changed row (``flag_probabilities``); a row whose context is not listed
  is not coded (it has no change). The flags of super-row ``u`` (rows ``16u .. 16u + 15``) are one row of the
  binary coder: lane ``i`` is row ``16u + i``, coded when that row exists and its context is listed.
- **Flagged rows**: a row flagged 1 codes its lanes as modes 1 and 2 do (lane ``l`` is coded when its element
  exists and its class is in P, with ``p_l = p1[class]``), except that while no coded lane before it has
  decoded 1, lane ``l`` uses its *chain probability* ``q_l`` (``chain_probabilities``): about the chance that
  lane ``l`` changed given that one of lanes ``l .. 15`` did. So the row's first change costs what it would
  in mode 2 less what its flag already said.
- **Order**: the block's *steps* are, for each super-row in order, its flag row and then its flagged rows in
  order; step ``s`` goes to position group ``s mod gp`` (so consecutive steps are independent), and a group's
  stream holds its steps in order.
- A flagged row must have a change: one whose lanes all decode 0 is corrupt, and so is a block with more
  flagged rows than changes.
"""

from __future__ import annotations

import numpy as np

from syncd.errors import DeltaError
from syncd.ops import _format as fmt
from syncd.ops.reference import binary_rans as br
from syncd.ops.reference import context as ctx

_RECIPROCAL = np.array(fmt.CHAIN_RECIPROCAL, np.int64)
_ONE = 1 << fmt.BIN_PROB_BITS


def row_contexts(classes: np.ndarray) -> np.ndarray:
    """The context of every row of a block whose elements have ``classes``: the largest class in the row
    (a partial last row: among its elements)."""
    rows = (classes.size + fmt.LANES - 1) // fmt.LANES
    c = np.zeros(rows * fmt.LANES, np.int64)
    c[: classes.size] = classes
    return c.reshape(rows, fmt.LANES).max(axis=1) if rows else np.zeros(0, np.int64)


def changed_rows(changed: np.ndarray) -> np.ndarray:
    """Whether each row of a block has a change (``changed``: one bool per element)."""
    rows = (changed.size + fmt.LANES - 1) // fmt.LANES
    c = np.zeros(rows * fmt.LANES, bool)
    c[: changed.size] = changed
    return c.reshape(rows, fmt.LANES).any(axis=1)


def flag_probabilities(contexts: np.ndarray, flags: np.ndarray) -> np.ndarray:
    """The encoder's flag probability of each context (int64[16], in 1/2**16): for a context with changed
    rows, the share of its rows that changed (``context.continue_probability``: rounded, clamped to
    1..65535); 0 for the others (not listed: their rows are not coded)."""
    rows = np.bincount(contexts, minlength=fmt.CLASSES)
    hit = np.bincount(contexts[flags], minlength=fmt.CLASSES)
    return np.array([ctx.continue_probability(int(hit[c]), int(rows[c])) if hit[c] else 0
                     for c in range(fmt.CLASSES)], np.int64)


def chain_probabilities(p: np.ndarray) -> np.ndarray:
    """The chain probabilities ``q`` of one flagged row's lanes (``p``: int64[16], 0 for a lane not coded).

    With ``S_l = p_l + ... + p_15``, ``e = max(0, bitlen(S_l) - 4)`` and ``m = S_l >> e`` (its leading 4 bits):
    ``q_l = (p_l * CHAIN_RECIPROCAL[m]) >> (e + 2)``, about ``p_l * 2**16 / S_l``, clamped to ``p_l .. 65535``.
    Integer arithmetic only: the product is below 2**31 (``m >= 8`` whenever ``e > 0``); where ``S_l >= 2**16``
    the estimate is at most ``p_l``, so ``q_l = p_l``; a lane not coded gets 0."""
    p = np.asarray(p, np.int64)
    s = np.cumsum(p[::-1])[::-1]
    e = np.maximum(0, np.frexp(s.astype(np.float64))[1].astype(np.int64) - 4)  # bitlen(S) - 4, exactly
    q = (p * _RECIPROCAL[s >> e]) >> (e + 2)
    return np.minimum(_ONE - 1, np.maximum(p, q))


def _lanes(classes: np.ndarray, p1: np.ndarray, t: int):
    """Row ``t``'s lanes: which exist, their probabilities ``p`` (0: not coded) and chain probabilities."""
    lo, hi = t * fmt.LANES, min(classes.size, (t + 1) * fmt.LANES)
    p = np.zeros(fmt.LANES, np.int64)
    p[: hi - lo] = p1[classes[lo:hi].astype(np.int64)]
    return lo, hi, p, chain_probabilities(p)


def _flag_row(contexts: np.ndarray, pa: np.ndarray, u: int):
    """Super-row ``u``'s flag lanes: the rows (clipped), which are coded, their probabilities."""
    t = u * fmt.LANES + np.arange(fmt.LANES)
    exists = t < contexts.size
    pr = np.where(exists, pa[contexts[np.minimum(t, contexts.size - 1)]], 0)
    return t, pr > 0, pr


def encode_positions(classes: np.ndarray, p1: np.ndarray, pa: np.ndarray, groups: int,
                     changed: np.ndarray) -> list[bytes]:
    """The position streams of a mode-3 block (``changed``: one bool per element)."""
    contexts, flags = row_contexts(classes), changed_rows(changed)
    steps = []
    for u in range((contexts.size + fmt.LANES - 1) // fmt.LANES):
        t, coded, pr = _flag_row(contexts, pa, u)
        hit = flags[np.minimum(t, contexts.size - 1)] & coded
        steps.append((coded, pr, hit))
        for row in t[hit].tolist():
            lo, hi, p, q = _lanes(classes, p1, row)
            bits = np.zeros(fmt.LANES, bool)
            bits[: hi - lo] = changed[lo:hi]
            first = int(np.argmax(bits))
            steps.append((p > 0, np.where(np.arange(fmt.LANES) <= first, q, p), bits))
    return [br.encode_group(steps[g::groups]) for g in range(groups)]


def decode_positions(decoders: list, classes: np.ndarray, p1: np.ndarray, pa: np.ndarray, n_changed: int,
                     what: str) -> np.ndarray:
    """Inverse of ``encode_positions``: one bool per element (the caller checks the streams' ends and the
    number of changes). ``DeltaError`` for a flagged row without a change, or more flagged rows than
    ``n_changed``."""
    groups = len(decoders)
    contexts = row_contexts(classes)
    changed = np.zeros(classes.size, bool)
    flagged = step = 0
    for u in range((contexts.size + fmt.LANES - 1) // fmt.LANES):
        t, coded, pr = _flag_row(contexts, pa, u)
        hit = decoders[step % groups].row(coded, pr) & coded
        step += 1
        flagged += int(hit.sum())
        if flagged > n_changed:
            raise DeltaError(f"{what}: {flagged} rows flagged, more than the {n_changed} changes")
        for row in t[hit].tolist():
            lo, hi, p, q = _lanes(classes, p1, row)
            bits = decode_chain_row(decoders[step % groups], p, q)[: hi - lo]
            step += 1
            if not bits.any():
                raise DeltaError(f"{what}: flagged row {row} has no change")
            changed[lo:hi] = bits
    return changed


def decode_chain_row(dec: br.GroupDecoder, p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """One flagged row: lanes in ascending order, lane ``l`` (coded when ``p_l > 0``) with ``q_l`` while no
    coded lane before it has decoded 1, else ``p_l``."""
    coded = p > 0
    pr = np.zeros(fmt.LANES, np.int64)
    seen = False
    slots = dec.slots()
    for lane in range(fmt.LANES):  # as stated; a lane's bit depends only on its own state and probability
        if coded[lane]:
            pr[lane] = p[lane] if seen else q[lane]
            seen |= bool(slots[lane] < pr[lane])
    return dec.row(coded, pr)
