"""Reference delta codec (formats 1 and 2, ``docs/delta-format.md``): the executable spec.

Works on NumPy views of raw element bits. ``encode`` and ``decode_into`` are what every other backend must
match: the native and GPU encoders produce the same bytes for the same input, and every decoder accepts
every encoder's blobs. This module holds the header-level codec and the format-1 block payload;
``delta_v2`` holds format 2's payloads, whose context blocks need the old values (``context``) to decode.
An element's coded change is ``syncd/ops/_bits.py`` (``changes`` here finds it with the same key).
"""

from __future__ import annotations

import numpy as np

from syncd.errors import DeltaError
from syncd.ops import _format as fmt
from syncd.ops._bits import apply_values, to_key
from syncd.ops._checksum_math import raw_after
from syncd.ops.reference import checksum as ck
from syncd.ops.reference import context as v2ctx
from syncd.ops.reference import delta_v2 as v2
from syncd.ops.reference.block_v1 import decode_block, encode_block

__all__ = ["changes", "bits_view", "encode", "checksum_of", "pack", "unpack", "decode_into", "changed_words"]


def changes(old_bits: np.ndarray, new_bits: np.ndarray, dtype: fmt.DType) -> tuple[np.ndarray, np.ndarray]:
    """Positions (int64, ascending) of changed elements and their values ``v = zigzag(delta) - 1`` (uint64),
    where ``delta`` is the key difference (``_bits.to_key``) as a signed ``bits``-wide integer; ``apply_values``
    inverts it."""
    pos = np.flatnonzero(old_bits != new_bits)
    w = dtype.bits
    mask = (1 << w) - 1
    d = (to_key(new_bits[pos], dtype).astype(np.uint64) - to_key(old_bits[pos], dtype).astype(np.uint64))
    d &= np.uint64(mask)
    # signed interpretation, then zigzag, all within w bits
    sign = (d >> np.uint64(w - 1)) & np.uint64(1)
    u = ((d << np.uint64(1)) & np.uint64(mask)) ^ (np.uint64(0) - sign) & np.uint64(mask)
    return pos.astype(np.int64), u - np.uint64(1)


def bits_view(arr: np.ndarray, dtype: fmt.DType) -> np.ndarray:
    return np.ascontiguousarray(arr).reshape(-1).view(np.uint8).view(dtype.np_uint)


def encode(old: np.ndarray, new: np.ndarray, dtype: fmt.DType, shape, block_log2: int = fmt.DEFAULT_BLOCK_LOG2,
           version: int = fmt.DEFAULT_FORMAT) -> bytes:
    """Blob taking ``old`` to ``new`` (arrays of raw bytes or element bits of equal size)."""
    ob, nb = bits_view(old, dtype), bits_view(new, dtype)
    pos, v = changes(ob, nb, dtype)
    ctx_of = None
    if version == 2:
        ctx_of = lambda b, lo, hi: v2ctx.block_context(ob[lo:hi], dtype)  # noqa: E731
    return pack(dtype, shape, block_log2, pos, v, checksum_of(ob), checksum_of(nb), version, ctx_of)


def checksum_of(bits: np.ndarray) -> int:
    return ck.checksum_bytes(bits.view(np.uint8))


def pack(dtype: fmt.DType, shape, block_log2: int, pos: np.ndarray, v: np.ndarray, base_ck: int, new_ck: int,
         version: int = fmt.DEFAULT_FORMAT, context=None) -> bytes:
    """Blob from global change positions (ascending) and values: the entropy-coding half of ``encode``,
    shared with the GPU encoders, which find the changes on the device. Format 2 needs ``context(b, lo, hi)``:
    block ``b``'s ``(e_top, classes)`` (``context.block_context`` of its old elements ``lo:hi``)."""
    if version not in fmt.FORMAT_VERSIONS:
        raise DeltaError(f"unknown delta format version {version} (known: {fmt.FORMAT_VERSIONS})")
    if version == 2 and context is None:
        raise DeltaError("format 2 needs the old tensor's context to encode")
    numel = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
    n_blocks = (numel + (1 << block_log2) - 1) >> block_log2
    edges = np.searchsorted(pos, np.arange(n_blocks + 1, dtype=np.int64) << block_log2)
    payloads, table = [], []
    for b in range(n_blocks):
        lo, hi = edges[b], edges[b + 1]
        start = b << block_log2
        rel, vb = pos[lo:hi] - start, v[lo:hi]
        if hi == lo:
            payload = b""
        elif version == 1:
            payload = encode_block(rel, vb)
        else:
            span = min(1 << block_log2, numel - start)
            if v2.use_context(int(hi - lo), span, dtype):
                e_top, classes = context(b, start, start + span)
                payload = v2.encode_block(rel, vb, classes, e_top, dtype)
            else:  # mode 0: no context needed
                payload = v2.encode_block(rel, vb, np.zeros(span, np.uint8), 0, dtype)
        payloads.append(payload)
        table.append((len(payload), int(hi - lo), ck.checksum_bytes(payload) if payload else 0))
    header = fmt.pack_header(dtype, shape, block_log2, table, base_ck, new_ck, ck.checksum_bytes, version)
    return header + b"".join(payloads)


def unpack(blob, base_classes=None) -> tuple[fmt.Header, np.ndarray, np.ndarray]:
    """Parse and fully validate a blob into (header, global positions, values). Format 1 and mode-0 blocks
    do not need the base; a format-2 context block calls ``base_classes(b, lo, hi, e_top)`` for the classes
    of the old elements ``lo:hi`` of block ``b`` (``DeltaError`` when it is None)."""
    h = fmt.parse_header(blob, ck.checksum_bytes)
    data = bytes(blob)
    off = h.header_bytes
    all_pos, all_v = [], []
    for b, (plen, nchg, pck) in enumerate(h.blocks):
        payload = data[off : off + plen]
        off += plen
        if not nchg:
            continue
        what = f"block {b}"
        if ck.checksum_bytes(payload) != pck:
            raise DeltaError(f"{what}: payload checksum mismatch (corrupt or altered blob)")
        start, span = h.block_span(b)
        if h.version == 1:
            pos, v = decode_block(payload, nchg, span, h.dtype, what)
        else:
            def classes_for(e_top, b=b, start=start, span=span, what=what):
                if base_classes is None:
                    raise DeltaError(f"{what} is context-coded (format 2): decoding it needs the base tensor")
                return base_classes(b, start, start + span, e_top)
            pos, v = v2.decode_block(payload, nchg, classes_for, span, h.dtype, what)
        all_pos.append(pos + start)
        all_v.append(v)
    pos = np.concatenate(all_pos) if all_pos else np.empty(0, np.int64)
    v = np.concatenate(all_v) if all_v else np.empty(0, np.uint64)
    return h, pos, v


def decode_into(target: np.ndarray, blob, dtype: fmt.DType, shape, verify_base: bool = True) -> None:
    """Apply ``blob`` to ``target`` (raw bytes, modified in place). Everything is checked first; on any
    error ``target`` is unchanged and ``DeltaError`` says what is wrong."""
    h = fmt.parse_header(blob, ck.checksum_bytes)
    fmt.check_target(h, dtype, shape)
    tb = bits_view(target, dtype)
    if verify_base:  # first: with a wrong base, format 2's context blocks would fail to decode
        have = checksum_of(tb)
        if have != h.base_checksum:
            raise DeltaError(
                f"wrong base: blob expects base checksum {h.base_checksum:#018x}, target has {have:#018x}")
    h, pos, v = unpack(blob, lambda b, lo, hi, e_top: v2ctx.classes_of(tb[lo:hi], dtype, e_top))
    result = tb.copy()
    result[pos] = apply_values(tb[pos], v, dtype)
    if verify_base and checksum_of(result) != h.new_checksum:
        raise DeltaError("result checksum mismatch: the decoded tensor differs from the encoder's")
    tb[pos] = result[pos]


def changed_words(dtype: fmt.DType, words: np.ndarray, old_w: np.ndarray, pos: np.ndarray, values: np.ndarray,
                  first: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """What the native ``changed_words`` computes (``csrc/cpu/changed_words.h``): the element bits at ``pos``
    (uint64 positions, ascending) before and after the coded ``values``, read from the changed 64-bit words
    ``old_w`` at word indices ``words`` (``first`` marks each position that opens a new word), and what the
    checksum's raw sum gains when those words change. ``DeltaError`` for positions that do not ascend or a value
    too wide for the dtype."""
    if pos.size and np.any(pos[1:] <= pos[:-1]):
        raise DeltaError("change positions must ascend")
    if values.size and int(values.max()) > (1 << dtype.bits) - 2:
        raise DeltaError(f"value change {int(values.max())} too wide for the dtype")
    per_word = 64 // dtype.bits
    at = (np.cumsum(first) - 1) * per_word + (pos % np.uint64(per_word)).astype(np.int64)  # element in old_w
    old = old_w.view(dtype.np_uint)[at]
    new = np.ascontiguousarray(apply_values(old, values, dtype))
    new_w = old_w.copy()
    new_w.view(dtype.np_uint)[at] = new
    return old, new, raw_after(0, words, old_w, new_w)
