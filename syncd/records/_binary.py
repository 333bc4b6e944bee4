"""Bounded binary reading and LEB128 varints for the replay records (``docs/replay-format.md``): every failure is a
:class:`ReplayFormatError` naming what was being read. Private to :mod:`syncd.records`."""

from __future__ import annotations

import numpy as np

from syncd.errors import SyncdError


class ReplayFormatError(SyncdError, ValueError):
    """A replay record, kept set or routing blob is malformed or corrupt; nothing of it was used."""


def put_varint(out: bytearray, x: int) -> None:
    if x < 0:
        raise ValueError(f"varint of a negative number {x}")
    while x >= 0x80:
        out.append((x & 0x7F) | 0x80)
        x >>= 7
    out.append(x)


def put_id_list(out: bytearray, ids: np.ndarray) -> None:
    """Ascending distinct ids: varint count, varint first id, then a varint ``gap - 1`` per further id."""
    put_varint(out, int(ids.size))
    put_varint(out, int(ids[0]))
    for g in (ids[1:] - ids[:-1] - 1).tolist():
        put_varint(out, g)


class Reader:
    """Bounds-checked reading of a byte buffer; every failure is a ReplayFormatError naming ``what``."""

    def __init__(self, buf, what: str, pos: int = 0, end: int | None = None):
        self.buf = memoryview(buf).cast("B")
        self.pos = pos
        self.end = len(self.buf) if end is None else end
        self.what = what

    def fail(self, msg: str):
        raise ReplayFormatError(f"{self.what}: {msg} (at byte {self.pos})")

    def take(self, n: int) -> memoryview:
        if n < 0 or self.end - self.pos < n:
            self.fail(f"truncated: needs {n} more bytes, {self.end - self.pos} left")
        b = self.buf[self.pos:self.pos + n]
        self.pos += n
        return b

    def u8(self) -> int:
        return self.take(1)[0]

    def u32(self) -> int:
        return int.from_bytes(self.take(4), "little")

    def varint(self, limit: int, name: str) -> int:
        x, shift = 0, 0
        for _ in range(10):
            if self.pos >= self.end:
                self.fail(f"truncated varint ({name})")
            b = self.buf[self.pos]
            self.pos += 1
            x |= (b & 0x7F) << shift
            if not b & 0x80:
                if x > limit:
                    self.fail(f"{name} {x} exceeds its bound {limit}")
                return x
            shift += 7
        self.fail(f"varint ({name}) longer than 10 bytes")

    def varints(self, n: int, limit: int, name: str) -> np.ndarray:
        """``n`` varints (each at least one byte, so ``n`` is bounded by the bytes left)."""
        if n > self.end - self.pos:
            self.fail(f"{n} {name} cannot fit in {self.end - self.pos} bytes")
        return np.fromiter((self.varint(limit, name) for _ in range(n)), dtype=np.int64, count=n)

    def id_list(self, vocab_size: int, what: str, most: int | None = None) -> np.ndarray:
        """A :func:`put_id_list` list of ``1..most`` ids below ``vocab_size`` (ascending, distinct)."""
        n = self.varint(vocab_size if most is None else most, f"{what} count")
        if n == 0:
            self.fail(f"empty {what}")
        first = self.varint(vocab_size - 1, f"first {what} id")
        gaps = self.varints(n - 1, vocab_size, f"{what} gap")
        ids = np.empty(n, dtype=np.int64)
        ids[0] = first
        if n > 1:
            ids[1:] = first + np.cumsum(gaps + 1)
            if ids[-1] >= vocab_size:
                self.fail(f"{what} id {int(ids[-1])} outside the vocabulary of {vocab_size}")
        return ids
