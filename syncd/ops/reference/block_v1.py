"""Reference of format 1's block payload (and of format 2's mode-0 blocks): bucketed gaps and values, two
frequency tables, a raw-bits stream and two interleaved rANS states (``docs/delta-format.md``)."""

from __future__ import annotations

import struct

import numpy as np

from syncd.errors import DeltaError
from syncd.ops import _format as fmt
from syncd.ops._sections import Reader, read_table
from syncd.ops.reference import entropy as ent


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
    r = Reader(payload, what)
    models = [read_table(r), read_table(r)]
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

