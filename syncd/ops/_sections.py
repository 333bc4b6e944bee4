"""Reading a delta block payload's framing (``docs/delta-format.md``): a bounds-checked cursor, the frequency
tables, a context block's ``e_top``, and the size of every section (what ``delta.inspect`` reports).

The reference decoders (``syncd/ops/reference/``) read payloads with the same cursor and tables; the native
code states the same layout in ``csrc/``. Everything here raises ``DeltaError`` for a payload that does not
parse and never reads past its end. Pure functions.
"""

from __future__ import annotations

import struct

from syncd.errors import DeltaError
from syncd.ops import _format as fmt

__all__ = ["Reader", "read_table", "read_e_top", "V1_SECTIONS", "V2_SECTIONS", "sections"]

#: the sections of a format-1 payload (also a format-2 mode-0 payload after its mode byte)
V1_SECTIONS = ("tables", "lengths", "raw_bits", "rans")
#: the sections of format-2 payloads: the mode bytes, mode 0's format-1 sections and the context modes' ones
V2_SECTIONS = ("modes", "tables", "lengths", "raw_bits", "rans", "params", "positions", "values", "mantissa", "signs")


class Reader:
    """Bounds-checked cursor over a payload; every read past the end raises ``DeltaError``."""

    def __init__(self, data: bytes, what: str):
        self.data, self.pos, self.what = data, 0, what

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise DeltaError(f"{self.what}: truncated (needs {n} bytes at offset {self.pos} of {len(self.data)})")
        b = self.data[self.pos : self.pos + n]
        self.pos += n
        return b

    def varint(self) -> int:
        v = shift = 0
        while True:
            (byte,) = self.take(1)
            v |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return v
            shift += 7
            if shift > 28:
                raise DeltaError(f"{self.what}: varint too long")


def read_table(r: Reader) -> list[int]:
    """Read a frequency table (u8 span - 1, a presence bitmap, a varint per present symbol); validates the
    bitmap and the sum."""
    span = r.take(1)[0] + 1
    bitmap = r.take((span + 7) // 8)
    freqs = [0] * fmt.ALPHABET
    for s in range(span):
        if bitmap[s >> 3] >> (s & 7) & 1:
            f = r.varint()
            if f == 0 or f > fmt.PROB_SCALE:
                raise DeltaError(f"{r.what}: frequency {f} of symbol {s} out of range")
            freqs[s] = f
    if span % 8 and bitmap[-1] >> (span % 8):
        raise DeltaError(f"{r.what}: frequency table bitmap has bits past its span")
    if not freqs[span - 1]:
        raise DeltaError(f"{r.what}: frequency table span ends on an absent symbol")
    if sum(freqs) != fmt.PROB_SCALE:
        raise DeltaError(f"{r.what}: frequencies sum to {sum(freqs)}, expected {fmt.PROB_SCALE}")
    return freqs


def read_e_top(payload: bytes) -> int | None:
    """The ``e_top`` of a context payload (mode 1 or 2), None for mode 0 (does not validate the rest)."""
    if payload and payload[0] in fmt.CONTEXT_MODES and len(payload) >= fmt.CONTEXT_FIXED.size:
        return fmt.CONTEXT_FIXED.unpack_from(payload)[1]
    return None


def _v1_sections(payload: bytes, what: str) -> dict:
    r = Reader(payload, what)
    read_table(r)
    read_table(r)
    tables = r.pos
    (raw_len,) = struct.unpack("<I", r.take(4))
    r.take(raw_len)
    return {"tables": tables, "lengths": 4, "raw_bits": raw_len, "rans": len(payload) - r.pos}


def _v2_sections(payload: bytes, n_changed: int, what: str) -> dict:
    if not payload:
        raise DeltaError(f"{what}: empty payload")
    if payload[0] == fmt.MODE_ORDER0:
        return {"modes": 1, **_v1_sections(payload[1:], what)}
    r = Reader(payload, what)
    mode, _, gp, gv = fmt.CONTEXT_FIXED.unpack(r.take(fmt.CONTEXT_FIXED.size))
    (mask_p,) = struct.unpack("<H", r.take(2))
    r.take(2 * bin(mask_p).count("1"))
    if mode == fmt.MODE_ROW_FLAGS:  # the row contexts' flag probabilities
        (mask_r,) = struct.unpack("<H", r.take(2))
        r.take(2 * bin(mask_r).count("1"))
    (mask_v,) = struct.unpack("<H", r.take(2))
    for _ in range(bin(mask_v).count("1")):
        r.take(2 * ((1 << r.take(1)[0]) - 1))
    lens = [r.varint() for _ in range(gp + gv + 1)]
    params = r.pos - 1
    signs = (n_changed + 7) // 8
    if params + 1 + sum(lens) + signs != len(payload):
        raise DeltaError(f"{what}: section lengths do not add up to the payload")
    return {"modes": 1, "params": params, "positions": sum(lens[:gp]), "values": sum(lens[gp : gp + gv]),
            "mantissa": lens[-1], "signs": signs}


def sections(payload: bytes, version: int, n_changed: int, what: str) -> dict:
    """Bytes of each section of one block's payload (keys among :data:`V1_SECTIONS` for format 1, else
    :data:`V2_SECTIONS`). Format 1: frequency tables, the raw-bits length field, raw bits, rANS. Format 2: its
    mode byte, then mode 0's format-1 sections, or a context mode's parameters (with the stream lengths),
    position and value streams, mantissa bits and sign bits."""
    return _v1_sections(payload, what) if version == 1 else _v2_sections(payload, n_changed, what)
