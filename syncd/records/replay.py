"""Replay records (``docs/replay-format.md`` is the specification): their binary encodings. Part of the syncd
core, so that ``syncd.engine.replay`` (the recorder) and ``syncd.trainer.rl.rollouts`` (the reader) share it without
importing each other.

* **kept set** (the token ids top-k/top-p sampling could have chosen at one step; :mod:`syncd.records.replay_kept`):
  explicit (a sorted id list, a bitmap, the whole vocabulary, the sampled token alone) or, in format 2, to be
  rebuilt by the trainer from its own logits (the first ``n`` ranks, possibly with a few listed ids, and a 32-bit
  fingerprint) where the engine's margins show the ranking robust within the chunk's tolerance.
* **routing** (MoE top-k expert ids of ``n`` positions × ``L`` layers × ``k``): a small header, then every
  id in ``ceil(log2 E)`` bits, bit-packed LSB first (:func:`syncd.ops.replay.pack_routes`).
* **chunk** (one object in the store: consecutive tokens of one request): magic ``SRPL``, format version (2; 1 is
  still read), the request id, the kept-set tolerance (format 2), columns (versions run-length coded, token ids,
  float32 logprobs, kept sets, routing, the routing of prompt positions) and a 64-bit ``syncd.ops.checksum``
  trailer.

Where chunks live in the store and reading them back: :mod:`syncd.records.replay_store`.

Decoders treat their input as hostile: every length, count and id is bounds-checked before use, allocations
are bounded by the input's size, and anything malformed raises :class:`ReplayFormatError` (a
``ValueError``) saying what is wrong. Pure functions; thread-safe.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np

from syncd.records._binary import Reader as _Reader
from syncd.records._binary import ReplayFormatError, put_varint as _put_varint
from syncd.records.replay_kept import (MAX_TOLERANCE, MAX_VOCAB, KeptToRebuild, decode_kept, encode_kept,
                                       encode_kept_record, plan_kept, read_kept)

__all__ = ["ReplayFormatError", "KeptToRebuild", "encode_kept", "decode_kept", "encode_kept_record", "pack_routing",
           "unpack_routing", "TokenRecord", "ReplayChunk", "encode_chunk", "decode_chunk", "FORMAT_VERSION",
           "FORMAT_VERSIONS", "MAGIC"]

FORMAT_VERSION = 2
FORMAT_VERSIONS = (1, 2)
MAGIC = b"SRPL"
ROUTING_VERSION = 1
MAX_EXPERTS = 1 << 16
MAX_LAYERS = 1 << 12
MAX_TOP_K = 1 << 10
MAX_REQUEST_ID_BYTES = 4096
_FLAG_ROUTING, _FLAG_PROMPT_ROUTING = 1, 2


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
    the ``kept`` set and, for MoE, ``routing`` (``[layers, top_k]`` expert ids at the position whose logits
    sampled this token, i.e. ``position - 1``).

    ``kept`` as written: the ids, in rank order (descending scaled logit) when ``kept_margins`` is given, which
    are the sampler's gaps (``syncd.ops.replay.kept_sets``): with them and a chunk tolerance the encoder may write
    a form the trainer rebuilds. As read: ascending int64 ids, or a
    :class:`~syncd.records.replay_kept.KeptToRebuild`."""

    position: int
    index: int
    version: int | None
    token_id: int
    logprob: float
    kept: np.ndarray | KeptToRebuild
    routing: np.ndarray | None = None
    kept_margins: np.ndarray | None = None


@dataclass
class ReplayChunk:
    """Consecutive tokens of one request (positions ``first_position ...``), as stored in one object.
    ``prompt_routing`` (``[m, layers, top_k]``) covers positions ``prompt_routing_start ...`` that were
    processed without sampling a token (the prompt, except its last position). ``kept_tolerance``: the recorder's
    ``delta`` (format 2; 0 when it states none, and then every kept set is explicit): its sets to rebuild are exact
    for a trainer whose scaled logits differ from the engine's by at most that much each."""

    request_id: str
    vocab_size: int
    records: list[TokenRecord]
    num_experts: int = 0
    prompt_routing_start: int = 0
    prompt_routing: np.ndarray | None = None
    kept_tolerance: float = 0.0

    @property
    def first_position(self) -> int:
        return self.records[0].position


def _kept_blobs(chunk: ReplayChunk, version: int) -> list[bytes]:
    """The records' kept-set encodings (format ``version``); the fingerprints of sets that may be written to be
    rebuilt are computed in one op call."""
    recs, V = chunk.records, chunk.vocab_size
    if version == 1:
        if any(isinstance(r.kept, KeptToRebuild) for r in recs):
            raise ValueError("format 1 holds explicit kept sets only")
        return [encode_kept(r.kept, V) for r in recs]
    delta = float(np.float32(chunk.kept_tolerance))  # as the header states it
    blobs: list[bytes | None] = [None] * len(recs)
    todo = []
    for i, r in enumerate(recs):
        if isinstance(r.kept, KeptToRebuild):
            blobs[i] = encode_kept_record(r.kept, r.token_id, V, tolerance=delta)
            continue
        ids, m = plan_kept(r.kept, r.token_id, V, r.kept_margins, delta)
        if m:
            todo.append((i, ids, m))
        else:
            blobs[i] = encode_kept_record(ids, r.token_id, V)
    if todo:
        import torch

        from syncd.ops.replay import kept_fingerprint

        sizes = torch.tensor([ids.size for _, ids, _ in todo])
        fps = kept_fingerprint(torch.from_numpy(np.concatenate([ids for _, ids, _ in todo])),
                               torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)])).tolist()
        for (i, _, _), fp in zip(todo, fps):
            r = recs[i]
            blobs[i] = encode_kept_record(r.kept, r.token_id, V, margins=r.kept_margins, tolerance=delta,
                                          fingerprint=fp)
    return blobs


def encode_chunk(chunk: ReplayChunk, *, version: int = FORMAT_VERSION) -> bytes:
    """The bytes of ``chunk`` in format ``version`` (2; 1 for explicit kept sets only, as older writers wrote);
    records consecutive in position and index; all or none with routing."""
    from syncd.ops import checksum_bytes

    if version not in FORMAT_VERSIONS:
        raise ValueError(f"format version {version} (this writer knows {FORMAT_VERSIONS})")
    recs = chunk.records
    if not recs:
        raise ValueError("a chunk holds at least one token")
    for a, b in zip(recs, recs[1:]):
        if b.position != a.position + 1 or b.index != a.index + 1:
            raise ValueError("records of a chunk must be consecutive")
    has_routing = recs[0].routing is not None
    if any((r.routing is not None) != has_routing for r in recs):
        raise ValueError("either every record of a chunk has routing or none")
    delta = float(chunk.kept_tolerance)
    if not (math.isfinite(delta) and 0 <= delta <= MAX_TOLERANCE):
        raise ValueError(f"kept_tolerance {chunk.kept_tolerance!r} outside 0..{MAX_TOLERANCE}")
    has_prompt = chunk.prompt_routing is not None and len(chunk.prompt_routing) > 0
    rid = chunk.request_id.encode("utf-8")
    if len(rid) > MAX_REQUEST_ID_BYTES:
        raise ValueError(f"request id longer than {MAX_REQUEST_ID_BYTES} bytes")
    out = bytearray(MAGIC)
    out += bytes([version, (_FLAG_ROUTING if has_routing else 0) | (_FLAG_PROMPT_ROUTING if has_prompt else 0)])
    _put_varint(out, len(rid))
    out += rid
    _put_varint(out, chunk.vocab_size)
    if version >= 2:
        out += struct.pack("<f", delta)
    for x in (recs[0].position, recs[0].index, len(recs)):
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
    for blob in _kept_blobs(chunk, version):
        out += blob
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
    if version not in FORMAT_VERSIONS:
        r.fail(f"format version {version}, this reader knows {', '.join(map(str, FORMAT_VERSIONS))}")
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
    delta = 0.0
    if version >= 2:
        (delta,) = struct.unpack("<f", r.take(4))
        if not (math.isfinite(delta) and 0 <= delta <= MAX_TOLERANCE):
            r.fail(f"kept tolerance {delta!r} outside 0..{MAX_TOLERANCE}")
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
    kept = [read_kept(r, vocab, version, int(tokens[i]), delta) for i in range(n)]
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
    return ReplayChunk(rid, vocab, records, experts, prompt_start, prompt_routing, delta)
