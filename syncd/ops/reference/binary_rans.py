"""Reference of format 2's binary rANS: groups of ``LANES`` interleaved states coding yes/no decisions.

A *group stream* carries a sequence of *rows*; a row holds up to ``LANES`` decisions, one per lane, each with
its own probability. Lane ``l`` always uses state ``l``. Per coded lane, with ``p1`` the probability of a 1 in
1/2**16 (1..65535) and ``p0 = 2**16 - p1``, a decoder step of state ``x`` is::

    slot = x & 0xFFFF;  bit = slot < p1
    x = bit ? p1 * (x >> 16) + slot : p0 * (x >> 16) + slot - p1
    if x < 2**16:  x = (x << 16) | next word

Lanes of a row are stepped in ascending order, so the words a row reads come in lane order. A stream is
16 little-endian u32 initial states, each in [2**16, 2**32), then u16 words; after the last row every state
must be 2**16 again and every word must have been read. States stay below 2**32 and one renormalisation is
always enough, which is what lets SIMD decoders step 16 lanes at once (``csrc/cpu/binary_rans*``).
"""

from __future__ import annotations

import struct

import numpy as np

from syncd.errors import DeltaError
from syncd.ops._format import BIN_L, BIN_PROB_BITS, LANES

_ONE = 1 << BIN_PROB_BITS


def encode_group(rows) -> bytes:
    """The stream of one group. ``rows`` is a list of ``(coded, p1, bits)``, arrays of ``LANES`` (bool,
    integer 1..65535 where coded, bool), in decode order."""
    x = np.full(LANES, BIN_L, np.uint64)
    blocks = []
    for coded, p1, bits in reversed(rows):
        coded = np.asarray(coded, bool)
        p1 = np.asarray(p1, np.uint64)
        bits = np.asarray(bits, bool)
        f = np.where(bits, p1, np.uint64(_ONE) - p1)
        c = np.where(bits, np.uint64(0), p1)
        f = np.where(coded, f, np.uint64(1))
        emit = coded & (x >= (f << np.uint64(16)))
        blocks.append((x[emit] & np.uint64(0xFFFF)).astype("<u2").tobytes())
        x = np.where(emit, x >> np.uint64(16), x)
        q, r = x // f, x % f
        x = np.where(coded, (q << np.uint64(16)) + r + c, x)
    return x.astype("<u4").tobytes() + b"".join(reversed(blocks))


class GroupDecoder:
    """Steps the 16 states of one group stream over rows; every read is bounds-checked (``DeltaError``)."""

    def __init__(self, data: bytes, what: str):
        self.what = what
        if len(data) < 4 * LANES or (len(data) - 4 * LANES) % 2:
            raise DeltaError(f"{what}: binary stream of {len(data)} bytes is not 64 bytes of states plus words")
        self.x = np.array(struct.unpack(f"<{LANES}I", data[: 4 * LANES]), np.uint64)
        if (self.x < BIN_L).any():
            raise DeltaError(f"{what}: binary stream has an initial state below 2**16")
        self.words = np.frombuffer(data, "<u2", offset=4 * LANES).astype(np.uint64)
        self.pos = 0

    def slots(self) -> np.ndarray:
        """The low 16 bits of each state: lane ``l`` of the next row decodes 1 exactly when its slot is below
        its probability."""
        return self.x & np.uint64(0xFFFF)

    def row(self, coded, p1) -> np.ndarray:
        """Decodes one row; returns the bits (False where not coded)."""
        coded = np.asarray(coded, bool)
        p1 = np.asarray(p1, np.uint64)
        x = self.x
        slot = x & np.uint64(0xFFFF)
        bits = coded & (slot < p1)
        hi = x >> np.uint64(16)
        xn = np.where(bits, p1 * hi + slot, (np.uint64(_ONE) - p1) * hi + slot - p1)
        x = np.where(coded, xn, x)
        ren = coded & (x < BIN_L)
        need = int(ren.sum())
        if self.pos + need > self.words.size:
            raise DeltaError(f"{self.what}: binary stream truncated")
        x[ren] = (x[ren] << np.uint64(16)) | self.words[self.pos : self.pos + need]
        self.pos += need
        self.x = x
        return bits

    def finish(self) -> None:
        if (self.x != BIN_L).any() or self.pos != self.words.size:
            raise DeltaError(f"{self.what}: binary stream corrupt (final state check failed)")
