"""Reference of format 2's block payloads (``docs/delta-format.md``, format 2): the executable spec.

A format-2 payload starts with its mode byte. Mode 0 is the format-1 payload. Mode 1 (context) codes every
element's yes/no "changed" decision with the probability of its class (``context.py``) and each change's
value ``v`` (as in format 1: zigzag of the key delta, minus one) as ``v = 2 m + low``: ``low`` a raw bit, and
``m`` by its bit length ``nb`` plus the ``nb - 1`` bits below its leading one, raw. ``nb`` is coded by its
``T`` binary digits, most significant first, each with the probability of its node in the class's binary
tree (a class whose changes all have ``nb = 0`` codes nothing). Decisions travel in binary rANS group
streams (``binary_rans.py``). Mode 2, which encoders write, is mode 1 with the changes' value decisions
ordered by their tree's depth (``value_order``), so that SIMD decoders step rows whose lanes all have work.
Mode 3 is mode 2 with its positions coded by row flags first (``rows.py``): encoders write it for sparse
blocks (``context_mode``).
"""

from __future__ import annotations

import struct

import numpy as np

from syncd.errors import DeltaError
from syncd.ops import _format as fmt
from syncd.ops._sections import Reader
from syncd.ops.reference import binary_rans as br
from syncd.ops.reference import block_v1 as v1
from syncd.ops.reference import context as ctx
from syncd.ops.reference import entropy as ent
from syncd.ops.reference import rows as rf

def bit_length(m: np.ndarray) -> np.ndarray:
    """Bit length of each uint64 (0 for 0), exactly."""
    m = m.astype(np.uint64)
    nb = np.zeros(m.shape, np.int64)
    for k in range(64):
        live = (m >> np.uint64(k)) != 0
        if not live.any():
            break
        nb += live
    return nb


def groups_for(count: int) -> int:
    """Interleaved groups an encoder gives the value stream of ``count`` changes (1..ENCODER_MAX_GROUPS)."""
    return min(fmt.ENCODER_MAX_GROUPS, max(1, count // fmt.CHANGES_PER_GROUP))


def position_groups(span: int) -> int:
    """Interleaved groups an encoder gives the position stream of a block of ``span`` elements: one per
    ``ELEMENTS_PER_GROUP`` (decoding a group's rows is a chain of dependent steps, so a decoder wants several
    to interleave), 1..ENCODER_MAX_GROUPS."""
    return min(fmt.ENCODER_MAX_GROUPS, max(1, span // fmt.ELEMENTS_PER_GROUP))


def use_context(n_changed: int, span: int, dtype: fmt.DType) -> bool:
    """The encoders' choice of mode 1 for a block: float dtypes of 16 bits or more (integers have no exponent
    to model on, and format 1's bucketed values fit their deltas better; 8-bit floats, NVFP4's block scales,
    change too rarely to pay for the tables), blocks of at least CONTEXT_MIN_SPAN elements with at least
    CONTEXT_MIN_CHANGES changes and CONTEXT_MIN_CHANGES_PER_GROUP per position group (each group's states and
    ends cost 128 bytes)."""
    return (bool(dtype.exp_bits) and dtype.bits >= 16 and span >= fmt.CONTEXT_MIN_SPAN
            and n_changed >= max(fmt.CONTEXT_MIN_CHANGES, fmt.CONTEXT_MIN_CHANGES_PER_GROUP * position_groups(span)))


def context_mode(n_changed: int, span: int) -> int:
    """The mode encoders write a context block of ``n_changed`` changes in ``span`` elements in: 3 (row flags)
    when at most 1 / ROW_FLAGS_DENSITY of the elements change, else 2."""
    return fmt.MODE_ROW_FLAGS if n_changed * fmt.ROW_FLAGS_DENSITY <= span else fmt.MODE_CONTEXT_BY_DEPTH


# ------------------------------------------------------------------------------------------- rows


def position_rows(classes: np.ndarray, p1: np.ndarray, groups: int, changed: np.ndarray | None):
    """Rows of every position group, in decode order: vector ``t`` (elements 16t..16t+15 of the block) is a
    row of group ``t % groups``; a lane is coded when its element exists and its class has ``p1 > 0``."""
    span = classes.size
    rows = [[] for _ in range(groups)]
    for t in range((span + fmt.LANES - 1) // fmt.LANES):
        lo = t * fmt.LANES
        c = np.zeros(fmt.LANES, np.int64)
        live = np.zeros(fmt.LANES, bool)
        hi = min(span, lo + fmt.LANES)
        c[: hi - lo] = classes[lo:hi]
        live[: hi - lo] = True
        pl = p1[c]
        coded = live & (pl > 0)
        bits = np.zeros(fmt.LANES, bool)
        if changed is not None:
            bits[: hi - lo] = changed[lo:hi]
        rows[t % groups].append((coded, pl, bits))
    return rows


def value_steps(count: int, groups: int):
    """``(group, lo, hi)``: the lanes of each row group of the value streams, in decode order. The changes
    ``J`` of classes with a value tree are taken in steps of ``16 * groups``; in a step, group ``g`` takes the
    ``g``-th 16 of them (``J[lo:hi]``) and codes, in row ``r``, digit ``r`` of every lane whose tree has more
    than ``r`` levels."""
    step = fmt.LANES * max(groups, 1)
    for s0 in range(0, count, step):
        for g in range(groups):
            lo, hi = s0 + g * fmt.LANES, min(count, s0 + (g + 1) * fmt.LANES)
            if lo >= hi:
                return
            yield g, lo, hi


def tree_depth(max_nb: int) -> int:
    """Levels of a class's value tree: the binary digits of its largest bit length (0: nothing is coded)."""
    return int(max_nb).bit_length()


def tree_probabilities(nb: np.ndarray, depth: int) -> list[int]:
    """The encoder's node probabilities of one class (heap order, nodes 1 .. 2**depth - 1): at each node, the
    chance that the next digit of ``nb`` is 1 among the changes that reached it; 32768 for a node none
    reached."""
    reached = np.zeros(1 << depth, np.int64)
    ones = np.zeros(1 << depth, np.int64)
    u = np.ones(nb.size, np.int64)
    for r in range(depth):
        bit = (nb >> (depth - 1 - r)) & 1
        np.add.at(reached, u, 1)
        np.add.at(ones, u, bit)
        u = 2 * u + bit
    return [ctx.continue_probability(int(ones[k]), int(reached[k])) if reached[k] else 1 << 15
            for k in range(1, 1 << depth)]


def tree_tables(trees: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Per class its tree depth, and its node probabilities (a CLASSES x 128 array indexed by node; a lane past
    its last level sits on a leaf, 2**depth .. 2**(depth + 1) - 1, whose entry is never used)."""
    depth = np.array([(len(trees[c]) + 1).bit_length() - 1 for c in range(fmt.CLASSES)], np.int64)
    prob = np.zeros((fmt.CLASSES, 128), np.int64)
    for c in range(fmt.CLASSES):
        prob[c, 1 : 1 + len(trees[c])] = trees[c]
    return depth, prob


def _lanes(values: np.ndarray, lo: int, hi: int) -> np.ndarray:
    out = np.zeros(fmt.LANES, np.int64)
    out[: hi - lo] = values[lo:hi]
    return out


# ------------------------------------------------------------------------------------------- encode


def value_order(cls_j: np.ndarray, depth: np.ndarray, mode: int) -> np.ndarray:
    """The order ``J`` codes its changes in, as indices into ``cls_j`` (the classes of the changes with a
    value tree, in position order): position order in mode 1; in modes 2 and 3 by their class's tree depth, fewest
    levels first, then position (so that the 16 lanes of a row have about the same number of levels)."""
    if mode == fmt.MODE_CONTEXT:
        return np.arange(cls_j.size)
    return np.argsort(depth[cls_j], kind="stable")


def encode_block(pos: np.ndarray, v: np.ndarray, classes: np.ndarray, e_top: int, dtype: fmt.DType,
                 mode: int | None = None) -> bytes:
    """Payload of one block: changes at block-relative ``pos`` (ascending) with values ``v``; ``classes`` of
    every element of the block (from the old values and ``e_top``). ``mode``: the context mode a context
    block is written in (None: ``context_mode``'s choice, what encoders write; 1 and 2 for the blobs written
    before mode 3, or mode 2, existed)."""
    span, n = classes.size, pos.size
    if not use_context(n, span, dtype):
        return bytes([fmt.MODE_ORDER0]) + v1.encode_block(pos, v)
    mode = context_mode(n, span) if mode is None else mode
    v = v.astype(np.uint64)
    cls_ch = classes[pos].astype(np.int64)
    changed = np.zeros(span, bool)
    changed[pos] = True
    p1 = np.array(ctx.position_probabilities(np.bincount(cls_ch, minlength=fmt.CLASSES),
                                             ctx.sample_class_counts(classes), span), np.int64)
    m, low = v >> np.uint64(1), (v & np.uint64(1)).astype(bool)
    nb = bit_length(m)
    trees = []
    for c in range(fmt.CLASSES):
        nbc = nb[cls_ch == c]
        trees.append(tree_probabilities(nbc, tree_depth(int(nbc.max()) if nbc.size else 0)))
    gp = position_groups(span)
    if mode == fmt.MODE_ROW_FLAGS:
        pa = rf.flag_probabilities(rf.row_contexts(classes), rf.changed_rows(changed))
        pos_streams = rf.encode_positions(classes, p1, pa, gp, changed)
    else:
        pos_streams = [br.encode_group(r) for r in position_rows(classes, p1, gp, changed)]
    depth, prob = tree_tables(trees)
    jsel = depth[cls_ch] > 0
    order = value_order(cls_ch[jsel], depth, mode)
    cls_j, nb_j, m_j = cls_ch[jsel][order], nb[jsel][order], m[jsel][order]
    gv = groups_for(cls_j.size) if cls_j.size else 0
    vrows = [[] for _ in range(gv)]
    for g, lo, hi in value_steps(cls_j.size, gv):
        c, b, live = _lanes(cls_j, lo, hi), _lanes(nb_j, lo, hi), np.arange(fmt.LANES) < hi - lo
        t = np.where(live, depth[c], 0)
        u = np.ones(fmt.LANES, np.int64)
        for r in range(int(t.max())):
            active = t > r
            bit = (b >> np.maximum(t - 1 - r, 0)) & 1 & active
            vrows[g].append((active, prob[c, u], bit.astype(bool)))
            u = np.where(active, 2 * u + bit, u)
    val_streams = [br.encode_group(r) for r in vrows]
    mant = ent.BitWriter()
    for mi, ni in zip(m_j.tolist(), nb_j.tolist()):  # J order (changes outside J have nb = 0)
        if ni >= 2:
            mant.write(mi - (1 << (ni - 1)), ni - 1)
    mant_bytes = mant.getvalue()
    out = bytearray(fmt.CONTEXT_FIXED.pack(mode, e_top, gp, gv))
    out += struct.pack("<H", sum(1 << c for c in range(fmt.CLASSES) if p1[c]))
    out += b"".join(struct.pack("<H", int(p1[c])) for c in range(fmt.CLASSES) if p1[c])
    if mode == fmt.MODE_ROW_FLAGS:
        out += struct.pack("<H", sum(1 << c for c in range(fmt.CLASSES) if pa[c]))
        out += b"".join(struct.pack("<H", int(pa[c])) for c in range(fmt.CLASSES) if pa[c])
    out += struct.pack("<H", sum(1 << c for c in range(fmt.CLASSES) if trees[c]))
    for c in range(fmt.CLASSES):
        if trees[c]:
            out += struct.pack(f"<B{len(trees[c])}H", int(depth[c]), *trees[c])
    for s in pos_streams + val_streams:
        ent.write_varint(out, len(s))
    ent.write_varint(out, len(mant_bytes))
    out += b"".join(pos_streams) + b"".join(val_streams) + mant_bytes
    out += np.packbits(low, bitorder="little").tobytes()
    return bytes(out)


# ------------------------------------------------------------------------------------------- decode


def decode_block(payload: bytes, n_changed: int, classes_for, span: int, dtype: fmt.DType, what: str):
    """Inverse of ``encode_block``: block-relative positions (int64) and values (uint64), fully validated.
    ``classes_for(e_top)`` returns the classes of the block's old elements (only called for modes 1 and 2)."""
    if not payload:
        raise DeltaError(f"{what}: empty payload")
    if payload[0] == fmt.MODE_ORDER0:
        return v1.decode_block(payload[1:], n_changed, span, dtype, what)
    if payload[0] not in fmt.CONTEXT_MODES:
        raise DeltaError(f"{what}: unknown block mode {payload[0]}")
    r = Reader(payload, what)
    mode, e_top, gp, gv = fmt.CONTEXT_FIXED.unpack(r.take(fmt.CONTEXT_FIXED.size))
    if dtype.exp_bits and e_top >= 1 << dtype.exp_bits or not dtype.exp_bits and e_top:
        raise DeltaError(f"{what}: class origin {e_top} outside the exponent range of {dtype.name}")
    if not 1 <= gp <= fmt.MAX_GROUPS or gv > fmt.MAX_GROUPS:
        raise DeltaError(f"{what}: {gp} position and {gv} value groups (1..{fmt.MAX_GROUPS} and 0..)")
    (mask_p,) = struct.unpack("<H", r.take(2))
    if not dtype.exp_bits and mask_p & ~1:
        raise DeltaError(f"{what}: classes other than 0 for {dtype.name}, which has no exponent")
    p1 = np.zeros(fmt.CLASSES, np.int64)
    for c in range(fmt.CLASSES):
        if mask_p >> c & 1:
            (p1[c],) = struct.unpack("<H", r.take(2))
            if not p1[c]:
                raise DeltaError(f"{what}: class {c} listed with a zero change probability")
    pa = np.zeros(fmt.CLASSES, np.int64)
    if mode == fmt.MODE_ROW_FLAGS:
        (mask_r,) = struct.unpack("<H", r.take(2))
        if not dtype.exp_bits and mask_r & ~1:
            raise DeltaError(f"{what}: row contexts other than 0 for {dtype.name}, which has no exponent")
        for c in range(fmt.CLASSES):
            if mask_r >> c & 1:
                (pa[c],) = struct.unpack("<H", r.take(2))
                if not pa[c]:
                    raise DeltaError(f"{what}: row context {c} listed with a zero flag probability")
    (mask_v,) = struct.unpack("<H", r.take(2))
    if mask_v & ~mask_p:
        raise DeltaError(f"{what}: a value tree for a class that never changes")
    trees: list[list[int]] = [[] for _ in range(fmt.CLASSES)]
    for c in range(fmt.CLASSES):
        if mask_v >> c & 1:
            levels = r.take(1)[0]
            if not 1 <= levels <= tree_depth(dtype.bits - 1):
                raise DeltaError(f"{what}: class {c} has a value tree of {levels} levels "
                                 f"(1..{tree_depth(dtype.bits - 1)})")
            trees[c] = list(struct.unpack(f"<{(1 << levels) - 1}H", r.take(2 * ((1 << levels) - 1))))
            if 0 in trees[c]:
                raise DeltaError(f"{what}: class {c} has a zero node probability")
    lens = [r.varint() for _ in range(gp + gv + 1)]
    pos_dec = [br.GroupDecoder(r.take(n), f"{what} position group {g}") for g, n in enumerate(lens[:gp])]
    val_dec = [br.GroupDecoder(r.take(n), f"{what} value group {g}") for g, n in enumerate(lens[gp : gp + gv])]
    mant = ent.BitReader(r.take(lens[-1]), what)
    signs = r.take((n_changed + 7) // 8)
    if r.pos != len(payload):
        raise DeltaError(f"{what}: {len(payload) - r.pos} bytes after the sign bits")
    classes = classes_for(e_top)
    if mode == fmt.MODE_ROW_FLAGS:
        changed = rf.decode_positions(pos_dec, classes, p1, pa, n_changed, what)
    else:
        changed = np.zeros(span, bool)
        for g, rows in enumerate(position_rows(classes, p1, gp, None)):
            for t, (coded, pl, _) in enumerate(rows):
                lo = (t * gp + g) * fmt.LANES
                hi = min(span, lo + fmt.LANES)
                changed[lo:hi] = pos_dec[g].row(coded, pl)[: hi - lo]
    for d in pos_dec:
        d.finish()
    pos = np.flatnonzero(changed)
    if pos.size != n_changed:
        raise DeltaError(f"{what}: {pos.size} changes decoded, the block table says {n_changed}")
    cls_ch = classes[pos].astype(np.int64)
    depth, prob = tree_tables(trees)
    jsel = depth[cls_ch] > 0
    j_pos = np.flatnonzero(jsel)[value_order(cls_ch[jsel], depth, mode)]  # J's changes, in J order
    cls_j = cls_ch[j_pos]
    if (gv == 0) != (cls_j.size == 0):
        raise DeltaError(f"{what}: {gv} value groups for {cls_j.size} changes with a value tree")
    nb_j = np.zeros(cls_j.size, np.int64)
    for g, lo, hi in value_steps(cls_j.size, gv):
        c, live = _lanes(cls_j, lo, hi), np.arange(fmt.LANES) < hi - lo
        t = np.where(live, depth[c], 0)
        u = np.ones(fmt.LANES, np.int64)
        for r in range(int(t.max())):
            active = t > r
            u = np.where(active, 2 * u + val_dec[g].row(active, prob[c, u]), u)
        nb_j[lo:hi] = (u - (1 << t))[: hi - lo]
    for d in val_dec:
        d.finish()
    m = np.zeros(n_changed, np.uint64)
    for i, k in zip(j_pos.tolist(), nb_j.tolist()):  # the mantissa bits come in J order
        if k >= 1:
            m[i] = (1 << (k - 1)) | (mant.read(k - 1) if k >= 2 else 0)
    mant.finish()
    low = np.unpackbits(np.frombuffer(signs, np.uint8), bitorder="little")
    if low[n_changed:].any():
        raise DeltaError(f"{what}: sign bits past the last change")
    v = (m << np.uint64(1)) | low[:n_changed].astype(np.uint64)
    vmax = (1 << dtype.bits) - 2
    if n_changed and int(v.max()) > vmax:
        raise DeltaError(f"{what}: value change {int(v.max())} too wide for {dtype.name}")
    return pos.astype(np.int64), v

