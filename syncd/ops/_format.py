"""Constants and header layout of the delta blob format, versions 1 and 2 (see ``docs/delta-format.md``).

This module is the single Python statement of the format's fixed parts; the reference codec, the
ops and the tests use it. The native code in ``csrc/`` states the same numbers and the tests
check that both agree.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from syncd.errors import DeltaError

MAGIC = b"SYDL"
#: versions this build reads; both share the header and block table, and differ in the block payload.
FORMAT_VERSIONS = (1, 2)
#: what ``syncd.ops.delta.encode`` writes unless told otherwise (v2 needs the base to decode, see the docs).
DEFAULT_FORMAT = 1

#: log2 of the elements per block written by default (1 Mi elements, 2 MiB of bf16).
DEFAULT_BLOCK_LOG2 = 20
MIN_BLOCK_LOG2 = 8
MAX_BLOCK_LOG2 = 26
MAX_NDIM = 8
MAX_NUMEL = 1 << 48

#: rANS: 32-bit state, byte-wise renormalisation, probabilities in 1/2**PROB_BITS.
PROB_BITS = 14
PROB_SCALE = 1 << PROB_BITS
RANS_L = 1 << 23
ALPHABET = 256
#: values below DIRECT_SYMBOLS are their own symbol; larger ones are bucketed (see ``bucket``).
DIRECT_SYMBOLS = 16

# ---- format 2, context blocks (``syncd/ops/reference/context.py``, ``binary_rans.py``, ``delta_v2.py``)
#: block payload modes: 0 = the v1 payload (order-0, decodable without the base); 1, 2 and 3 = context-modelled
#: (2: the value decisions ordered by tree depth; 3: mode 2 whose positions are coded by row flags first).
#: Encoders write 2 and 3 (see ``ROW_FLAGS_DENSITY``); 1 stays readable.
MODE_ORDER0, MODE_CONTEXT, MODE_CONTEXT_BY_DEPTH, MODE_ROW_FLAGS = 0, 1, 2, 3
CONTEXT_MODES = (MODE_CONTEXT, MODE_CONTEXT_BY_DEPTH, MODE_ROW_FLAGS)
#: encoders write a context block in mode 3 when at most 1 / ROW_FLAGS_DENSITY of its elements change
#: (most rows of 16 then have no change and cost one flag), else in mode 2.
ROW_FLAGS_DENSITY = 32
#: mode 3's chain probabilities: CHAIN_RECIPROCAL[m] = 2**18 // m, m = 1..15 (the leading 4 bits of a sum)
CHAIN_RECIPROCAL = (0,) + tuple((1 << 18) // m for m in range(1, 16))
#: context classes of an element (from its old value's exponent, relative to the block's ``e_top``).
CLASSES = 16
#: binary rANS: states in [BIN_L, 2**32), 16-bit renormalisation words, probabilities in 1/2**16.
BIN_PROB_BITS = 16
BIN_L = 1 << 16
#: interleaved states come in groups of LANES, each group with its own word stream.
LANES = 16
MAX_GROUPS = 8
#: the encoder's statistics sample: block-relative elements i with i % SAMPLE_PERIOD < SAMPLE_RUN.
SAMPLE_PERIOD = 1 << 14
SAMPLE_RUN = 1 << 10
#: encoders write a context block when it has at least this many changes and elements.
CONTEXT_MIN_CHANGES = 256
CONTEXT_MIN_SPAN = 4096
CONTEXT_MIN_CHANGES_PER_GROUP = 128
#: elements per interleaved position group, changes per value group the encoders aim for (1..4 groups).
ELEMENTS_PER_GROUP = 1 << 16
CHANGES_PER_GROUP = 2048
ENCODER_MAX_GROUPS = 4
#: a context payload's first fields: mode, e_top, position groups, value groups
CONTEXT_FIXED = struct.Struct("<BHBB")

# header: magic, version u16, dtype u8, ndim u8, numel u64, block_log2 u8, 3 reserved, n_blocks u32,
# n_changed u64, base checksum u64, new checksum u64; then ndim u64 dims, n_blocks block entries, and a
# u64 checksum of everything before it.
HEADER_FIXED = struct.Struct("<4sHBBQB3xIQQQ")
BLOCK_ENTRY = struct.Struct("<IIQ")  # payload bytes, changed count, payload checksum
assert HEADER_FIXED.size == 48


@dataclass(frozen=True)
class DType:
    """How the codec sees one element type: its code in the blob, width in bits, whether it is a float, and
    (floats) where its exponent field sits: ``exp_bits`` bits from bit ``exp_shift`` (0, 0 for integers)."""

    code: int
    name: str
    bits: int
    is_float: bool
    exp_shift: int = 0
    exp_bits: int = 0

    @property
    def itemsize(self) -> int:
        return self.bits // 8

    @property
    def np_uint(self):
        return {8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint64}[self.bits]


DTYPES: dict[str, DType] = {
    d.name: d
    for d in [
        DType(1, "bfloat16", 16, True, 7, 8),
        DType(2, "float16", 16, True, 10, 5),
        DType(3, "float32", 32, True, 23, 8),
        DType(4, "float8_e4m3fn", 8, True, 3, 4),
        DType(5, "float8_e5m2", 8, True, 2, 5),
        DType(6, "uint8", 8, False),
        DType(7, "int8", 8, False),
        DType(8, "int16", 16, False),
        DType(9, "int32", 32, False),
        DType(10, "float64", 64, True, 52, 11),
        DType(11, "int64", 64, False),
        DType(12, "bool", 8, False),
    ]
}
DTYPE_BY_CODE: dict[int, DType] = {d.code: d for d in DTYPES.values()}


_BY_TORCH: dict = {}


def dtype_of(torch_dtype) -> DType:
    """The codec's view of a ``torch.dtype``; raises ``DeltaError`` for a dtype the format does not carry."""
    hit = _BY_TORCH.get(torch_dtype)
    if hit is not None:
        return hit
    name = str(torch_dtype).removeprefix("torch.")
    try:
        _BY_TORCH[torch_dtype] = DTYPES[name]
        return DTYPES[name]
    except KeyError:
        raise DeltaError(
            f"dtype {name} is not supported by the delta codec (supported: {', '.join(DTYPES)})"
        ) from None


@dataclass(frozen=True)
class Header:
    """The parsed fixed part of a blob. ``blocks`` holds (payload_bytes, n_changed, payload_checksum)."""

    version: int
    dtype: DType
    shape: tuple[int, ...]
    numel: int
    block_log2: int
    n_changed: int
    base_checksum: int
    new_checksum: int
    blocks: tuple[tuple[int, int, int], ...]
    header_bytes: int

    @property
    def block_elems(self) -> int:
        return 1 << self.block_log2

    def block_span(self, b: int) -> tuple[int, int]:
        """First element and element count of block ``b``."""
        start = b << self.block_log2
        return start, min(self.block_elems, self.numel - start)


def check_target(h: Header, dtype: DType, shape) -> None:
    """Raise ``DeltaError`` unless the blob of header ``h`` is for elements of ``dtype`` in ``shape``."""
    if h.dtype.code != dtype.code:
        raise DeltaError(f"blob is for dtype {h.dtype.name}, target is {dtype.name}")
    if tuple(h.shape) != tuple(shape):
        raise DeltaError(f"blob is for shape {tuple(h.shape)}, target has shape {tuple(shape)}")


def header_size(ndim: int, n_blocks: int) -> int:
    return HEADER_FIXED.size + 8 * ndim + BLOCK_ENTRY.size * n_blocks + 8


def pack_header(dtype: DType, shape, block_log2: int, blocks, base_checksum: int, new_checksum: int,
                checksum_bytes, version: int = DEFAULT_FORMAT) -> bytes:
    """Serialise a header; ``checksum_bytes`` is the byte checksum used for the trailing header checksum."""
    numel = 1
    for s in shape:
        numel *= int(s)
    n_changed = sum(b[1] for b in blocks)
    parts = [HEADER_FIXED.pack(MAGIC, version, dtype.code, len(shape), numel, block_log2,
                               len(blocks), n_changed, base_checksum, new_checksum)]
    parts += [struct.pack("<Q", int(s)) for s in shape]
    parts += [BLOCK_ENTRY.pack(*b) for b in blocks]
    body = b"".join(parts)
    return body + struct.pack("<Q", checksum_bytes(body))


def parse_header(blob, checksum_bytes) -> Header:
    """Parse and validate the header of ``blob`` (bytes-like). Raises ``DeltaError`` saying what is wrong.

    Checks magic, version, dtype, rank, sizes, the block table against the blob length, and the header
    checksum. Payloads are not read.
    """
    mv = memoryview(blob).cast("B")
    n = len(mv)
    if n < HEADER_FIXED.size:
        raise DeltaError(f"blob truncated: {n} bytes, shorter than the {HEADER_FIXED.size}-byte header")
    (magic, version, code, ndim, numel, block_log2, n_blocks, n_changed, base_ck,
     new_ck) = HEADER_FIXED.unpack_from(mv, 0)
    if magic != MAGIC:
        raise DeltaError(f"not a syncd delta blob: magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version not in FORMAT_VERSIONS:
        raise DeltaError(f"unsupported delta format version {version} (this build reads "
                         f"{', '.join(map(str, FORMAT_VERSIONS))})")
    if code not in DTYPE_BY_CODE:
        raise DeltaError(f"corrupt header: unknown dtype code {code}")
    if ndim > MAX_NDIM:
        raise DeltaError(f"corrupt header: rank {ndim} exceeds {MAX_NDIM}")
    if not MIN_BLOCK_LOG2 <= block_log2 <= MAX_BLOCK_LOG2:
        raise DeltaError(f"corrupt header: block size 2**{block_log2} outside 2**{MIN_BLOCK_LOG2}..2**{MAX_BLOCK_LOG2}")
    if numel > MAX_NUMEL:
        raise DeltaError(f"corrupt header: {numel} elements exceeds the limit {MAX_NUMEL}")
    expect_blocks = (numel + (1 << block_log2) - 1) >> block_log2
    if n_blocks != expect_blocks:
        raise DeltaError(f"corrupt header: {n_blocks} blocks, expected {expect_blocks} for {numel} elements")
    hsize = header_size(ndim, n_blocks)
    if n < hsize:
        raise DeltaError(f"blob truncated: {n} bytes, shorter than its {hsize}-byte header and block table")
    (stored,) = struct.unpack_from("<Q", mv, hsize - 8)
    if checksum_bytes(mv[: hsize - 8]) != stored:
        raise DeltaError("corrupt header: header checksum mismatch")
    shape = struct.unpack_from(f"<{ndim}Q", mv, HEADER_FIXED.size)
    prod = 1
    for s in shape:
        prod *= s
    if prod != numel:
        raise DeltaError(f"corrupt header: shape {tuple(shape)} has {prod} elements, header says {numel}")
    off = HEADER_FIXED.size + 8 * ndim
    blocks = tuple(BLOCK_ENTRY.unpack_from(mv, off + i * BLOCK_ENTRY.size) for i in range(n_blocks))
    total = hsize
    count = 0
    for i, (plen, nchg, _) in enumerate(blocks):
        span = min(1 << block_log2, numel - (i << block_log2))
        if nchg > span:
            raise DeltaError(f"corrupt header: block {i} claims {nchg} changes in {span} elements")
        if (nchg == 0) != (plen == 0):
            raise DeltaError(f"corrupt header: block {i} has {nchg} changes but a {plen}-byte payload")
        total += plen
        count += nchg
    if count != n_changed:
        raise DeltaError(f"corrupt header: blocks hold {count} changes, header says {n_changed}")
    if total != n:
        what = "truncated" if total > n else "has trailing bytes"
        raise DeltaError(f"blob {what}: {n} bytes, header and payloads need {total}")
    return Header(version, DTYPE_BY_CODE[code], tuple(shape), numel, block_log2, n_changed, base_ck, new_ck,
                  blocks, hsize)
