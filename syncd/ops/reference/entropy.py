"""Reference entropy coding of a block's changes: symbol bucketing, frequency tables, interleaved rANS,
and the raw-bits stream. Pure Python; the spec that ``csrc/cpu/entropy.h`` implements. Decoders read with the
ops' bounds-checked cursor and table reader (``syncd/ops/_sections.py``).
"""

from __future__ import annotations

import struct

from syncd.errors import DeltaError
from syncd.ops._format import DIRECT_SYMBOLS, PROB_BITS, PROB_SCALE, RANS_L
from syncd.ops._sections import Reader


def bucket(v: int) -> tuple[int, int, int]:
    """Split ``v >= 0`` into (symbol, number of extra bits, extra bits).

    ``v < 16`` is its own symbol. Otherwise, with ``nb = v.bit_length()``, the symbol is
    ``16 + 4 * (nb - 5) + (two bits below the leading one)`` and the ``nb - 3`` lowest bits travel raw.
    """
    if v < DIRECT_SYMBOLS:
        return v, 0, 0
    nb = v.bit_length()
    extra_n = nb - 3
    top2 = (v >> extra_n) & 3
    return DIRECT_SYMBOLS + 4 * (nb - 5) + top2, extra_n, v & ((1 << extra_n) - 1)


def unbucket_base(sym: int) -> tuple[int, int]:
    """Inverse of ``bucket`` for the symbol: (base value, number of extra bits)."""
    if sym < DIRECT_SYMBOLS:
        return sym, 0
    nb = (sym - DIRECT_SYMBOLS) // 4 + 5
    top2 = (sym - DIRECT_SYMBOLS) % 4
    extra_n = nb - 3
    return (4 | top2) << extra_n, extra_n


def normalize(counts: list[int]) -> list[int]:
    """Scale symbol counts to frequencies summing to ``PROB_SCALE``; every present symbol keeps >= 1.

    Deterministic integer rule (all backends must match it): ``f = max(1, c * SCALE // total)``; while the
    sum is too large, take one from the largest ``f > 1`` (lowest symbol on ties); if too small, give the
    rest to the symbol with the largest count (lowest symbol on ties).
    """
    total = sum(counts)
    freqs = [max(1, c * PROB_SCALE // total) if c else 0 for c in counts]
    excess = sum(freqs) - PROB_SCALE
    while excess > 0:
        best = -1
        for s, f in enumerate(freqs):
            if f > 1 and (best < 0 or f > freqs[best]):
                best = s
        freqs[best] -= 1
        excess -= 1
    if excess < 0:
        best = max(range(len(counts)), key=lambda s: (counts[s], -s))
        freqs[best] -= excess
    return freqs


def write_varint(out: bytearray, v: int) -> None:
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)


def write_table(out: bytearray, freqs: list[int]) -> None:
    """u8 (span - 1), a presence bitmap of ceil(span / 8) bytes (LSB first), then a varint per present
    symbol. ``span`` is one past the largest present symbol."""
    span = max(s for s, f in enumerate(freqs) if f) + 1
    out.append(span - 1)
    bitmap = bytearray((span + 7) // 8)
    for s in range(span):
        if freqs[s]:
            bitmap[s >> 3] |= 1 << (s & 7)
    out += bitmap
    for s in range(span):
        if freqs[s]:
            write_varint(out, freqs[s])


def cumulative(freqs: list[int]) -> list[int]:
    cum, acc = [], 0
    for f in freqs:
        cum.append(acc)
        acc += f
    return cum


def rans_encode(symbols: list[int], models: list[list[int]]) -> bytes:
    """Encode ``symbols``; symbol ``j`` uses model ``j % 2`` and rANS state ``j % 2``.

    Output: the two final states (u32 LE each, state 0 first), then the renormalisation bytes in the order
    the decoder reads them.
    """
    cums = [cumulative(m) for m in models]
    x = [RANS_L, RANS_L]
    out = bytearray()
    for j in range(len(symbols) - 1, -1, -1):
        st = j & 1
        s = symbols[j]
        f, c = models[st][s], cums[st][s]
        xs = x[st]
        x_max = ((RANS_L >> PROB_BITS) << 8) * f
        while xs >= x_max:
            out.append(xs & 0xFF)
            xs >>= 8
        x[st] = ((xs // f) << PROB_BITS) + (xs % f) + c
    out.reverse()
    return struct.pack("<II", x[0], x[1]) + bytes(out)


def rans_decoder(r: Reader, models: list[list[int]], n_symbols: int):
    """Yield ``n_symbols`` symbols from the rest of ``r``; after the last, checks that both states are back
    at their initial value and every byte was consumed (else ``DeltaError``)."""
    luts = []
    for m in models:
        lut = bytearray(PROB_SCALE)
        for s, c in enumerate(cumulative(m)):
            lut[c : c + m[s]] = bytes([s]) * m[s]
        luts.append(lut)
    cums = [cumulative(m) for m in models]
    x = list(struct.unpack("<II", r.take(8)))
    data, pos, end = r.data, r.pos, len(r.data)
    mask = PROB_SCALE - 1
    for j in range(n_symbols):
        st = j & 1
        xs = x[st]
        slot = xs & mask
        s = luts[st][slot]
        xs = models[st][s] * (xs >> PROB_BITS) + slot - cums[st][s]
        while xs < RANS_L:
            if pos >= end:
                raise DeltaError(f"{r.what}: entropy-coded stream truncated")
            xs = (xs << 8) | data[pos]
            pos += 1
        x[st] = xs
        yield s
    if x != [RANS_L, RANS_L] or pos != end:
        raise DeltaError(f"{r.what}: entropy-coded stream corrupt (final state check failed)")
    r.pos = pos


class BitWriter:
    def __init__(self):
        self.acc, self.n = 0, 0

    def write(self, value: int, nbits: int) -> None:
        self.acc |= value << self.n
        self.n += nbits

    def getvalue(self) -> bytes:
        return self.acc.to_bytes((self.n + 7) // 8, "little")


class BitReader:
    def __init__(self, data: bytes, what: str):
        self.acc, self.total, self.n, self.what = int.from_bytes(data, "little"), 8 * len(data), 0, what

    def read(self, nbits: int) -> int:
        if self.n + nbits > self.total:
            raise DeltaError(f"{self.what}: raw-bits stream truncated")
        v = (self.acc >> self.n) & ((1 << nbits) - 1)
        self.n += nbits
        return v

    def finish(self) -> None:
        if (self.total - self.n) >= 8 or self.acc >> self.n:
            raise DeltaError(f"{self.what}: raw-bits stream has unused bits")
