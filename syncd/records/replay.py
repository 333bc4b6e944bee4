"""Replay records, version 1 (``docs/replay-format.md`` is the specification): their binary encodings. Part of
the syncd core, so that
``engine.replay`` (the recorder) and ``trainer.rollouts`` (the reader) share it without importing each other.

* **kept set** (the token ids top-k/top-p sampling could have chosen at one step): a tag byte, then the
  smaller of a sorted id list (gaps as LEB128 varints), a bitmap over the vocabulary, or nothing when the
  whole vocabulary was kept.
* **routing** (MoE top-k expert ids of ``n`` positions × ``L`` layers × ``k``): a small header, then every
  id in ``ceil(log2 E)`` bits, bit-packed LSB first (:func:`syncd.ops.replay.pack_routes`).
* **chunk** (one object in the store: consecutive tokens of one request): magic ``SRPL``, version, the
  request id, columns (versions run-length coded, token ids, float32 logprobs, kept sets, routing, the
  routing of prompt positions) and a 64-bit ``syncd.ops.checksum`` trailer.

Where chunks live in the store and reading them back: :mod:`syncd.records.replay_store`.

Decoders treat their input as hostile: every length, count and id is bounds-checked before use, allocations
are bounded by the input's size, and anything malformed raises :class:`ReplayFormatError` (a
``ValueError``) saying what is wrong. Pure functions; thread-safe.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from syncd.errors import SyncdError

__all__ = ["ReplayFormatError", "encode_kept", "decode_kept", "pack_routing", "unpack_routing",
           "TokenRecord", "ReplayChunk", "encode_chunk", "decode_chunk", "FORMAT_VERSION", "MAGIC"]

FORMAT_VERSION = 1
MAGIC = b"SRPL"
KEPT_VERSION = 1
ROUTING_VERSION = 1
KEPT_LIST, KEPT_BITMAP, KEPT_ALL = 0, 1, 2
MAX_VOCAB = 1 << 26
MAX_EXPERTS = 1 << 16
MAX_LAYERS = 1 << 12
MAX_TOP_K = 1 << 10
MAX_REQUEST_ID_BYTES = 4096
_FLAG_ROUTING, _FLAG_PROMPT_ROUTING = 1, 2


class ReplayFormatError(SyncdError, ValueError):
    """A replay record, kept set or routing blob is malformed or corrupt; nothing of it was used."""


# ------------------------------------------------------------------------------------------ primitives


def _put_varint(out: bytearray, x: int) -> None:
    if x < 0:
        raise ValueError(f"varint of a negative number {x}")
    while x >= 0x80:
        out.append((x & 0x7F) | 0x80)
        x >>= 7
    out.append(x)


class _Reader:
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


# ------------------------------------------------------------------------------------------ kept sets


def encode_kept(ids, vocab_size: int) -> bytes:
    """The kept set ``ids`` (distinct token ids in ``[0, vocab_size)``, any order, at least one) in the
    smallest of the three v1 forms. ValueError for ids out of range, duplicates or an empty set."""
    if not 1 <= vocab_size <= MAX_VOCAB:
        raise ValueError(f"vocab_size {vocab_size} outside 1..{MAX_VOCAB}")
    a = np.sort(np.asarray(ids, dtype=np.int64).reshape(-1))
    if a.size == 0:
        raise ValueError("a kept set holds at least one token")
    if a[0] < 0 or a[-1] >= vocab_size:
        raise ValueError(f"kept ids outside 0..{vocab_size - 1}")
    if a.size > 1 and not np.all(a[1:] > a[:-1]):
        raise ValueError("kept ids repeat")
    if a.size == vocab_size:
        return bytes([KEPT_VERSION << 4 | KEPT_ALL])
    lst = bytearray([KEPT_VERSION << 4 | KEPT_LIST])
    _put_varint(lst, int(a.size))
    _put_varint(lst, int(a[0]))
    for g in (a[1:] - a[:-1] - 1).tolist():
        _put_varint(lst, g)
    bitmap_len = 1 + (vocab_size + 7) // 8
    if len(lst) <= bitmap_len:
        return bytes(lst)
    bits = np.zeros(vocab_size, dtype=np.uint8)
    bits[a] = 1
    return bytes([KEPT_VERSION << 4 | KEPT_BITMAP]) + np.packbits(bits, bitorder="little").tobytes()


def _read_kept(r: _Reader, vocab_size: int) -> np.ndarray:
    tag = r.u8()
    if tag >> 4 != KEPT_VERSION:
        r.fail(f"kept set of encoding version {tag >> 4}, this reader knows {KEPT_VERSION}")
    mode = tag & 0xF
    if mode == KEPT_ALL:
        return np.arange(vocab_size, dtype=np.int64)
    if mode == KEPT_LIST:
        n = r.varint(vocab_size, "kept count")
        if n == 0:
            r.fail("empty kept set")
        first = r.varint(vocab_size - 1, "first kept id")
        gaps = r.varints(n - 1, vocab_size, "kept gap")
        ids = np.empty(n, dtype=np.int64)
        ids[0] = first
        if n > 1:
            ids[1:] = first + np.cumsum(gaps + 1)
            if ids[-1] >= vocab_size:
                r.fail(f"kept id {int(ids[-1])} outside the vocabulary of {vocab_size}")
        return ids
    if mode == KEPT_BITMAP:
        raw = np.frombuffer(r.take((vocab_size + 7) // 8), dtype=np.uint8)
        bits = np.unpackbits(raw, bitorder="little")
        if bits[vocab_size:].any():
            r.fail("kept bitmap has bits set past the vocabulary")
        ids = np.flatnonzero(bits[:vocab_size]).astype(np.int64)
        if ids.size == 0:
            r.fail("empty kept set")
        return ids
    r.fail(f"unknown kept-set form {mode}")


def decode_kept(buf, vocab_size: int) -> np.ndarray:
    """Ascending int64 ids of an :func:`encode_kept` blob (the whole buffer). Raises ReplayFormatError."""
    if not 1 <= vocab_size <= MAX_VOCAB:
        raise ValueError(f"vocab_size {vocab_size} outside 1..{MAX_VOCAB}")
    r = _Reader(buf, "kept set")
    ids = _read_kept(r, vocab_size)
    if r.pos != r.end:
        r.fail(f"{r.end - r.pos} trailing bytes")
    return ids


# ------------------------------------------------------------------------------------------ routing


def pack_routing(ids, num_experts: int) -> bytes:
    """Expert ids ``[n, layers, top_k]`` (each in ``[0, num_experts)``) bit-packed, with their header."""
    import torch

    from syncd.ops.replay import pack_routes

    a = np.asarray(ids, dtype=np.int64)
    if a.ndim != 3:
        raise ValueError(f"routing must be [positions, layers, top_k], got shape {a.shape}")
    n, L, k = a.shape
    if not 1 <= num_experts <= MAX_EXPERTS or L > MAX_LAYERS or k > MAX_TOP_K:
        raise ValueError(f"routing bounds: experts {num_experts} (1..{MAX_EXPERTS}), layers {L}, top_k {k}")
    out = bytearray([ROUTING_VERSION << 4])
    for x in (num_experts, L, k, n):
        _put_varint(out, x)
    return bytes(out) + pack_routes(torch.from_numpy(a), num_experts, backend="reference").numpy().tobytes()


def _read_routing(r: _Reader) -> tuple[np.ndarray, int]:
    tag = r.u8()
    if tag >> 4 != ROUTING_VERSION or tag & 0xF:
        r.fail(f"routing of encoding version {tag >> 4}.{tag & 0xF}, this reader knows {ROUTING_VERSION}.0")
    E = r.varint(MAX_EXPERTS, "num_experts")
    if E == 0:
        r.fail("num_experts is 0")
    L = r.varint(MAX_LAYERS, "layers")
    k = r.varint(MAX_TOP_K, "top_k")
    import torch

    from syncd.ops.replay import bits_per_id, unpack_routes

    left = r.end - r.pos
    b = bits_per_id(E)
    per_position = L * k * b
    n = r.varint((8 * left) // per_position if per_position else 1 << 40, "positions")
    count = n * L * k
    raw = torch.tensor(np.frombuffer(r.take((count * b + 7) // 8), dtype=np.uint8), dtype=torch.uint8)
    try:
        vals = unpack_routes(raw, count, E, backend="reference")
    except ValueError as exc:
        r.fail(str(exc).removeprefix("unpack_routes: "))
    return vals.numpy().reshape(n, L, k), E


def unpack_routing(buf) -> tuple[np.ndarray, int]:
    """``(ids [n, layers, top_k] int64, num_experts)`` of a :func:`pack_routing` blob (the whole buffer).
    Raises ReplayFormatError."""
    r = _Reader(buf, "routing")
    out = _read_routing(r)
    if r.pos != r.end:
        r.fail(f"{r.end - r.pos} trailing bytes")
    return out


# ------------------------------------------------------------------------------------------ chunks


@dataclass
class TokenRecord:
    """What the engine did for one generated token: the weight ``version`` it was sampled with (None:
    weights of no published version), its absolute ``position`` in the sequence, its ``index`` among the
    tokens this engine generated for the request, ``token_id``, ``logprob`` under the sampling distribution,
    the ``kept`` set (ascending ids) and, for MoE, ``routing`` (``[layers, top_k]`` expert ids at the
    position whose logits sampled this token, i.e. ``position - 1``)."""

    position: int
    index: int
    version: int | None
    token_id: int
    logprob: float
    kept: np.ndarray
    routing: np.ndarray | None = None


@dataclass
class ReplayChunk:
    """Consecutive tokens of one request (positions ``first_position ...``), as stored in one object.
    ``prompt_routing`` (``[m, layers, top_k]``) covers positions ``prompt_routing_start ...`` that were
    processed without sampling a token (the prompt, except its last position)."""

    request_id: str
    vocab_size: int
    records: list[TokenRecord]
    num_experts: int = 0
    prompt_routing_start: int = 0
    prompt_routing: np.ndarray | None = None

    @property
    def first_position(self) -> int:
        return self.records[0].position


def encode_chunk(chunk: ReplayChunk) -> bytes:
    """The v1 bytes of ``chunk`` (records consecutive in position and index; all or none with routing)."""
    from syncd.ops import checksum_bytes

    recs = chunk.records
    if not recs:
        raise ValueError("a chunk holds at least one token")
    for a, b in zip(recs, recs[1:]):
        if b.position != a.position + 1 or b.index != a.index + 1:
            raise ValueError("records of a chunk must be consecutive")
    has_routing = recs[0].routing is not None
    if any((r.routing is not None) != has_routing for r in recs):
        raise ValueError("either every record of a chunk has routing or none")
    has_prompt = chunk.prompt_routing is not None and len(chunk.prompt_routing) > 0
    rid = chunk.request_id.encode("utf-8")
    if len(rid) > MAX_REQUEST_ID_BYTES:
        raise ValueError(f"request id longer than {MAX_REQUEST_ID_BYTES} bytes")
    out = bytearray(MAGIC)
    out += bytes([FORMAT_VERSION, (_FLAG_ROUTING if has_routing else 0) | (_FLAG_PROMPT_ROUTING if has_prompt else 0)])
    _put_varint(out, len(rid))
    out += rid
    for x in (chunk.vocab_size, recs[0].position, recs[0].index, len(recs)):
        _put_varint(out, x)
    runs: list[list[int]] = []  # versions, run-length coded: (version + 1, or 0 for None; run length)
    for r in recs:
        v = 0 if r.version is None else r.version + 1
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    _put_varint(out, len(runs))
    for v, n in runs:
        _put_varint(out, v)
        _put_varint(out, n)
    for r in recs:
        if not 0 <= r.token_id < chunk.vocab_size:
            raise ValueError(f"token id {r.token_id} outside the vocabulary of {chunk.vocab_size}")
        _put_varint(out, r.token_id)
    out += np.asarray([r.logprob for r in recs], dtype="<f4").tobytes()
    for r in recs:
        out += encode_kept(r.kept, chunk.vocab_size)
    if has_routing:
        out += pack_routing(np.stack([np.asarray(r.routing) for r in recs]), chunk.num_experts)
    if has_prompt:
        _put_varint(out, chunk.prompt_routing_start)
        out += pack_routing(chunk.prompt_routing, chunk.num_experts)
    out += struct.pack("<Q", checksum_bytes(bytes(out)))
    return bytes(out)


def decode_chunk(buf) -> ReplayChunk:
    """The chunk in ``buf`` (the whole object). Raises ReplayFormatError for anything malformed: a wrong
    magic, version or checksum, a truncated or oversized field, ids out of range, trailing bytes."""
    from syncd.ops import checksum_bytes

    data = bytes(buf)
    r = _Reader(data, "replay chunk")
    if len(data) < len(MAGIC) + 2 + 8:
        r.fail(f"only {len(data)} bytes")
    if data[:4] != MAGIC:
        r.fail(f"bad magic {data[:4]!r} (expected {MAGIC!r})")
    (want,) = struct.unpack("<Q", data[-8:])
    if checksum_bytes(data[:-8]) != want:
        r.fail("checksum mismatch: the chunk is corrupt")
    r.end = len(data) - 8
    r.pos = 4
    version = r.u8()
    if version != FORMAT_VERSION:
        r.fail(f"format version {version}, this reader knows {FORMAT_VERSION}")
    flags = r.u8()
    if flags & ~(_FLAG_ROUTING | _FLAG_PROMPT_ROUTING):
        r.fail(f"unknown flags {flags:#x}")
    try:
        rid = bytes(r.take(r.varint(MAX_REQUEST_ID_BYTES, "request id length"))).decode("utf-8")
    except UnicodeDecodeError:
        r.fail("request id is not UTF-8")
    vocab = r.varint(MAX_VOCAB, "vocab_size")
    if vocab == 0:
        r.fail("vocab_size is 0")
    first_pos = r.varint(1 << 40, "first position")
    first_index = r.varint(1 << 40, "first index")
    n = r.varint(r.end - r.pos, "token count")
    if n == 0:
        r.fail("no tokens")
    versions: list[int | None] = []
    for _ in range(r.varint(n, "version runs")):
        v = r.varint(1 << 62, "version")
        run = r.varint(n - len(versions), "version run length")
        if run == 0:
            r.fail("empty version run")
        versions += [None if v == 0 else v - 1] * run
    if len(versions) != n:
        r.fail(f"version runs cover {len(versions)} of {n} tokens")
    tokens = r.varints(n, vocab - 1, "token id")
    logprobs = np.frombuffer(r.take(4 * n), dtype="<f4")
    kept = [_read_kept(r, vocab) for _ in range(n)]
    routing, experts = None, 0
    if flags & _FLAG_ROUTING:
        routing, experts = _read_routing(r)
        if routing.shape[0] != n:
            r.fail(f"routing covers {routing.shape[0]} positions, the chunk has {n} tokens")
    prompt_start, prompt_routing = 0, None
    if flags & _FLAG_PROMPT_ROUTING:
        prompt_start = r.varint(1 << 40, "prompt routing start")
        prompt_routing, e2 = _read_routing(r)
        if experts and e2 != experts:
            r.fail("prompt routing and token routing disagree on the number of experts")
        if routing is not None and prompt_routing.shape[1:] != routing.shape[1:]:
            r.fail("prompt routing and token routing disagree on layers or top_k")
        experts = e2
    if r.pos != r.end:
        r.fail(f"{r.end - r.pos} trailing bytes")
    records = [TokenRecord(first_pos + i, first_index + i, versions[i], int(tokens[i]), float(logprobs[i]),
                           kept[i], None if routing is None else routing[i]) for i in range(n)]
    return ReplayChunk(rid, vocab, records, experts, prompt_start, prompt_routing)
