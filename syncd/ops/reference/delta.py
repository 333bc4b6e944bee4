"""Reference delta codec (format v1, ``docs/delta-format.md``): the executable spec.

Works on NumPy views of raw element bits. ``encode`` and ``decode_into`` are what every other backend must
match: the native and GPU encoders produce the same bytes for the same input, and every decoder accepts
every encoder's blobs.
"""

from __future__ import annotations

import struct

import numpy as np

from syncd.errors import DeltaError
from syncd.ops import _format as fmt
from syncd.ops.reference import checksum as ck
from syncd.ops.reference import entropy as ent


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
    if not dtype.is_float:
        return key
    u = dtype.np_uint
    sign = u(1 << (dtype.bits - 1))
    pos = (key & sign) != 0
    return np.where(pos, key ^ sign, ~key).astype(u)


def changes(old_bits: np.ndarray, new_bits: np.ndarray, dtype: fmt.DType) -> tuple[np.ndarray, np.ndarray]:
    """Positions (int64, ascending) of changed elements and their values ``v = zigzag(delta) - 1`` (uint64),
    where ``delta`` is the key difference as a signed ``bits``-wide integer."""
    pos = np.flatnonzero(old_bits != new_bits)
    w = dtype.bits
    mask = (1 << w) - 1
    d = (to_key(new_bits[pos], dtype).astype(np.uint64) - to_key(old_bits[pos], dtype).astype(np.uint64))
    d &= np.uint64(mask)
    # signed interpretation, then zigzag, all within w bits
    sign = (d >> np.uint64(w - 1)) & np.uint64(1)
    u = ((d << np.uint64(1)) & np.uint64(mask)) ^ (np.uint64(0) - sign) & np.uint64(mask)
    return pos.astype(np.int64), u - np.uint64(1)


def apply_values(old_bits: np.ndarray, v: np.ndarray, dtype: fmt.DType) -> np.ndarray:
    """New element bits from old bits and coded values ``v`` (inverse of ``changes``)."""
    w = dtype.bits
    mask = np.uint64((1 << w) - 1)
    u = v.astype(np.uint64) + np.uint64(1)
    d = (u >> np.uint64(1)) ^ (np.uint64(0) - (u & np.uint64(1)))
    key = (to_key(old_bits, dtype).astype(np.uint64) + d) & mask
    return from_key(key.astype(dtype.np_uint), dtype)


def encode_block(pos: np.ndarray, v: np.ndarray) -> bytes:
    """Payload of one block with changes at block-relative ``pos`` (ascending) and values ``v``."""
    gaps = np.diff(pos, prepend=-1) - 1
    symbols: list[int] = []
    raw = ent.BitWriter()
    counts = [[0] * fmt.ALPHABET, [0] * fmt.ALPHABET]
    for g, val in zip(gaps.tolist(), v.tolist()):
        for m, x in enumerate((g, val)):
            s, n, extra = ent.bucket(x)
            symbols.append(s)
            counts[m][s] += 1
            if n:
                raw.write(extra, n)
    models = [ent.normalize(c) for c in counts]
    out = bytearray()
    for m in models:
        ent.write_table(out, m)
    raw_bytes = raw.getvalue()
    out += struct.pack("<I", len(raw_bytes))
    out += raw_bytes
    out += ent.rans_encode(symbols, models)
    return bytes(out)


def decode_block(payload: bytes, n_changed: int, span: int, dtype: fmt.DType, what: str):
    """Inverse of ``encode_block``: block-relative positions and values, fully validated."""
    r = ent.Reader(payload, what)
    models = [ent.read_table(r), ent.read_table(r)]
    (raw_len,) = struct.unpack("<I", r.take(4))
    bits = ent.BitReader(r.take(raw_len), what)
    vmax = (1 << dtype.bits) - 2
    pos = np.empty(n_changed, np.int64)
    vals = np.empty(n_changed, np.uint64)
    prev = -1
    syms = ent.rans_decoder(r, models, 2 * n_changed)
    for i in range(n_changed):
        for m in (0, 1):
            base, n = ent.unbucket_base(next(syms))
            x = base + bits.read(n) if n else base
            if m == 0:
                prev = prev + 1 + x
                if prev >= span:
                    raise DeltaError(f"{what}: change position {prev} outside the block of {span} elements")
                pos[i] = prev
            else:
                if x > vmax:
                    raise DeltaError(f"{what}: value change {x} too wide for {dtype.name}")
                vals[i] = x
    for _ in syms:  # runs the generator's end-of-stream checks
        pass
    bits.finish()
    return pos, vals


def bits_view(arr: np.ndarray, dtype: fmt.DType) -> np.ndarray:
    return np.ascontiguousarray(arr).reshape(-1).view(np.uint8).view(dtype.np_uint)


def encode(old: np.ndarray, new: np.ndarray, dtype: fmt.DType, shape, block_log2: int = fmt.DEFAULT_BLOCK_LOG2) -> bytes:
    """Blob taking ``old`` to ``new`` (arrays of raw bytes or element bits of equal size)."""
    ob, nb = bits_view(old, dtype), bits_view(new, dtype)
    pos, v = changes(ob, nb, dtype)
    return pack(dtype, shape, block_log2, pos, v, checksum_of(ob), checksum_of(nb))


def checksum_of(bits: np.ndarray) -> int:
    return ck.checksum_bytes(bits.view(np.uint8))


def pack(dtype: fmt.DType, shape, block_log2: int, pos: np.ndarray, v: np.ndarray, base_ck: int, new_ck: int) -> bytes:
    """Blob from global change positions (ascending) and values: the entropy-coding half of ``encode``,
    shared with the GPU encoders, which find the changes on the device."""
    numel = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
    n_blocks = (numel + (1 << block_log2) - 1) >> block_log2
    edges = np.searchsorted(pos, np.arange(n_blocks + 1, dtype=np.int64) << block_log2)
    payloads, table = [], []
    for b in range(n_blocks):
        lo, hi = edges[b], edges[b + 1]
        payload = encode_block(pos[lo:hi] - (b << block_log2), v[lo:hi]) if hi > lo else b""
        payloads.append(payload)
        table.append((len(payload), int(hi - lo), ck.checksum_bytes(payload) if payload else 0))
    header = fmt.pack_header(dtype, shape, block_log2, table, base_ck, new_ck, ck.checksum_bytes)
    return header + b"".join(payloads)


def unpack(blob) -> tuple[fmt.Header, np.ndarray, np.ndarray]:
    """Parse and fully validate a blob into (header, global positions, values). Does not need the base."""
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
        pos, v = decode_block(payload, nchg, span, h.dtype, what)
        all_pos.append(pos + start)
        all_v.append(v)
    pos = np.concatenate(all_pos) if all_pos else np.empty(0, np.int64)
    v = np.concatenate(all_v) if all_v else np.empty(0, np.uint64)
    return h, pos, v


def check_target(h: fmt.Header, dtype: fmt.DType, shape) -> None:
    if h.dtype.code != dtype.code:
        raise DeltaError(f"blob is for dtype {h.dtype.name}, target is {dtype.name}")
    if tuple(h.shape) != tuple(shape):
        raise DeltaError(f"blob is for shape {tuple(h.shape)}, target has shape {tuple(shape)}")


def decode_into(target: np.ndarray, blob, dtype: fmt.DType, shape, verify_base: bool = True) -> None:
    """Apply ``blob`` to ``target`` (raw bytes, modified in place). Everything is checked first; on any
    error ``target`` is unchanged and ``DeltaError`` says what is wrong."""
    h, pos, v = unpack(blob)
    check_target(h, dtype, shape)
    tb = bits_view(target, dtype)
    if verify_base:
        have = checksum_of(tb)
        if have != h.base_checksum:
            raise DeltaError(
                f"wrong base: blob expects base checksum {h.base_checksum:#018x}, target has {have:#018x}")
    result = tb.copy()
    result[pos] = apply_values(tb[pos], v, dtype)
    if verify_base and checksum_of(result) != h.new_checksum:
        raise DeltaError("result checksum mismatch: the decoded tensor differs from the encoder's")
    tb[pos] = result[pos]
