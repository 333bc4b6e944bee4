"""Kept-set encodings of the replay records (``docs/replay-format.md``, "Kept set"). Part of the core, shared by
the recorder (``syncd.engine.replay``) and the reader (``syncd.trainer.rl.rollouts``).

* **version 1** (chunks of format 1; :func:`encode_kept`): the ids, as the smaller of a sorted id list (gaps as
  LEB128 varints) and a bitmap over the vocabulary, or nothing when the whole vocabulary was kept.
* **version 2** (chunks of format 2; :func:`encode_kept_record`): the same explicit forms, plus *sampled* (the
  set is the sampled token alone: no payload), *top* (the set is the first ``n`` ranks of the sampling logits:
  ``n`` and a 32-bit fingerprint) and *top + extra* (the first ``m`` ranks and the listed ids of the ranks after
  them). The top forms are written only where the recorder's margins show the ranking robust: a trainer whose
  scaled logits are within the chunk's tolerance ``delta`` of the engine's (each entry) ranks the first ``m``
  ids alike whenever ``z[rank m] - z[rank m + 1] > 2 * delta``; it rebuilds the set from its own logits
  (``syncd.ops.replay.rebuild_kept``) and the fingerprint (``syncd.ops.replay.kept_fingerprint``) verifies it.

Decoders treat their input as hostile (bounds-checked, allocations bounded by the input) and raise
:class:`ReplayFormatError`. Pure functions; thread-safe.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from syncd.records._binary import Reader, ReplayFormatError, put_id_list, put_varint

__all__ = ["KeptToRebuild", "ReplayFormatError", "encode_kept", "decode_kept", "encode_kept_record", "plan_kept",
           "read_kept", "kept_form", "MAX_VOCAB", "MAX_TOLERANCE"]

MAX_VOCAB = 1 << 26
MAX_TOLERANCE = 1e3
LIST, BITMAP, ALL, SAMPLED, TOP, TOP_EXTRA = range(6)
_FORM_NAMES = ("list", "bitmap", "all", "sampled", "top", "top+extra")


@dataclass(frozen=True, eq=False)
class KeptToRebuild:
    """A kept set the recorder did not list: the first ``top`` ranks of the sampling logits (descending scaled
    logit, ties by the lower id) and the ``extra`` ids (ascending, none of them among those ranks), in all
    :attr:`size` ids whose ``syncd.ops.replay.kept_fingerprint`` is ``fingerprint``. ``tolerance``: the chunk's
    ``delta``, the largest difference per scaled logit under which the rebuild is exact."""

    top: int
    extra: np.ndarray
    fingerprint: int
    tolerance: float

    @property
    def size(self) -> int:
        return self.top + int(self.extra.size)


def kept_form(blob: bytes) -> str:
    """The name of an encoded kept set's form (``list``, ``bitmap``, ``all``, ``sampled``, ``top``, ``top+extra``),
    from its first byte; ReplayFormatError for an empty blob or an unknown form."""
    if not blob or blob[0] & 15 >= len(_FORM_NAMES) or blob[0] >> 4 not in (1, 2):
        raise ReplayFormatError(f"not an encoded kept set (first byte {blob[:1].hex() or 'missing'})")
    return _FORM_NAMES[blob[0] & 15]


def _sorted_ids(ids, vocab_size: int) -> np.ndarray:
    if not 1 <= vocab_size <= MAX_VOCAB:
        raise ValueError(f"vocab_size {vocab_size} outside 1..{MAX_VOCAB}")
    a = np.sort(np.asarray(ids, dtype=np.int64).reshape(-1))
    if a.size == 0:
        raise ValueError("a kept set holds at least one token")
    if a[0] < 0 or a[-1] >= vocab_size:
        raise ValueError(f"kept ids outside 0..{vocab_size - 1}")
    if a.size > 1 and not np.all(a[1:] > a[:-1]):
        raise ValueError("kept ids repeat")
    return a


def _explicit(a: np.ndarray, vocab_size: int, version: int) -> bytes:
    """The smallest explicit form of the ascending ids ``a`` (the list on a tie with the bitmap)."""
    if a.size == vocab_size:
        return bytes([version << 4 | ALL])
    lst = bytearray([version << 4 | LIST])
    put_id_list(lst, a)
    if len(lst) <= 1 + (vocab_size + 7) // 8:
        return bytes(lst)
    bits = np.zeros(vocab_size, dtype=np.uint8)
    bits[a] = 1
    return bytes([version << 4 | BITMAP]) + np.packbits(bits, bitorder="little").tobytes()


def encode_kept(ids, vocab_size: int) -> bytes:
    """The kept set ``ids`` (distinct token ids in ``[0, vocab_size)``, any order, at least one) in the smallest of
    the three version-1 forms. ValueError for ids out of range, duplicates or an empty set."""
    return _explicit(_sorted_ids(ids, vocab_size), vocab_size, 1)


def plan_kept(kept, token_id: int, vocab_size: int, margins=None, tolerance: float = 0.0) -> tuple[np.ndarray, int]:
    """``(ascending ids, m)`` of one record's kept set: ``m`` is the longest robust prefix of the ranked set
    (the largest ``j`` with ``margins[j - 1] > 2 * tolerance``; the set in rank order when ``margins`` is given),
    0 when none is or no top form applies (no margins or tolerance, a singleton, the whole vocabulary, a set
    without the sampled token, which the reader must see)."""
    ranked = np.asarray(kept, dtype=np.int64).reshape(-1)
    a = _sorted_ids(ranked, vocab_size)
    if margins is None or not tolerance > 0 or a.size in (1, vocab_size):
        return a, 0
    g = np.asarray(margins, dtype=np.float64).reshape(-1)
    if g.size != a.size:
        raise ValueError(f"{a.size} kept ids but {g.size} margins")
    j = int(np.searchsorted(a, token_id))
    if j >= a.size or a[j] != token_id:
        return a, 0
    robust = np.flatnonzero(g > 2 * tolerance)
    return a, int(robust[-1]) + 1 if robust.size else 0


def _top_form(top: int, extra: np.ndarray, fingerprint: int) -> bytes:
    out = bytearray([2 << 4 | (TOP_EXTRA if extra.size else TOP)])
    put_varint(out, top)
    if extra.size:
        put_id_list(out, extra)
    return bytes(out) + int(fingerprint).to_bytes(4, "little")


def encode_kept_record(kept, token_id: int, vocab_size: int, *, margins=None, tolerance: float = 0.0,
                       fingerprint: int | None = None) -> bytes:
    """One record's kept set in the smallest version-2 form (``docs/replay-format.md``). ``kept``: the ids (in rank
    order when ``margins`` is given, any order otherwise), or a decoded :class:`KeptToRebuild` (written back as
    it was); ``margins[j]``: ``z[rank j] - z[rank j + 1]`` of the sampler's scaled logits
    (``syncd.ops.replay.kept_sets``' gaps); ``tolerance``: the chunk's ``delta``; ``fingerprint``: of the set, when
    the caller computed it already. Without margins or tolerance only explicit forms are written. ValueError for
    malformed ids."""
    if isinstance(kept, KeptToRebuild):
        if not tolerance > 0 or not 1 <= kept.top <= kept.size <= vocab_size:
            raise ValueError("a kept set to rebuild needs a chunk tolerance > 0 and 1..V ids")
        return _top_form(kept.top, _sorted_ids(kept.extra, vocab_size) if kept.extra.size else kept.extra,
                         kept.fingerprint)
    a, m = plan_kept(kept, token_id, vocab_size, margins, tolerance)
    if a.size == 1 and int(a[0]) == token_id:
        return bytes([2 << 4 | SAMPLED])
    best = _explicit(a, vocab_size, 2)
    if m:
        if fingerprint is None:
            import torch

            from syncd.ops.replay import kept_fingerprint

            fingerprint = int(kept_fingerprint(torch.from_numpy(a), torch.tensor([0, a.size]))[0])
        extra = np.sort(np.asarray(kept, dtype=np.int64).reshape(-1)[m:])
        top = _top_form(m, extra, fingerprint)
        if len(top) < len(best):
            return top
    return best


@functools.lru_cache(maxsize=4)
def _whole_vocabulary(vocab_size: int) -> np.ndarray:
    """The ids of the 'all' form, one read-only array per vocabulary size shared by every record that has it: a
    one-byte form must not cost ``8 * V`` bytes per record (a 1 KB chunk would ask for gigabytes)."""
    ids = np.arange(vocab_size, dtype=np.int64)
    ids.flags.writeable = False
    return ids


def read_kept(r: Reader, vocab_size: int, version: int, token_id: int | None, tolerance: float):
    """One kept set of a chunk of format ``version`` (1 or 2): ascending int64 ids, or a :class:`KeptToRebuild`."""
    tag = r.u8()
    if tag >> 4 != version:
        r.fail(f"kept set of encoding version {tag >> 4} in a format-{version} chunk (this reader knows 1 and 2)")
    mode = tag & 0xF
    if mode == ALL:
        return _whole_vocabulary(vocab_size)
    if mode == LIST:
        return r.id_list(vocab_size, "kept set")
    if mode == BITMAP:
        raw = np.frombuffer(r.take((vocab_size + 7) // 8), dtype=np.uint8)
        bits = np.unpackbits(raw, bitorder="little")
        if bits[vocab_size:].any():
            r.fail("kept bitmap has bits set past the vocabulary")
        ids = np.flatnonzero(bits[:vocab_size]).astype(np.int64)
        if ids.size == 0:
            r.fail("empty kept set")
        return ids
    if version == 2 and mode == SAMPLED:
        if token_id is None:
            r.fail("a 'sampled' kept set needs its record's token id")
        return np.array([token_id], dtype=np.int64)
    if version == 2 and mode in (TOP, TOP_EXTRA):
        if not tolerance > 0:
            r.fail("a kept set to rebuild in a chunk that states no tolerance")
        if mode == TOP:
            top, extra = r.varint(vocab_size, "kept top"), np.zeros(0, dtype=np.int64)
            if top == 0:
                r.fail("kept top of 0 ids")
        else:
            top = r.varint(vocab_size - 1, "kept top")
            if top == 0:
                r.fail("kept top of 0 ids")
            extra = r.id_list(vocab_size, "kept extra", vocab_size - top)
        return KeptToRebuild(top, extra, r.u32(), tolerance)
    r.fail(f"unknown kept-set form {mode}")


def decode_kept(buf, vocab_size: int, *, token_id: int | None = None, tolerance: float = 0.0):
    """The kept set of an :func:`encode_kept` (version 1) or :func:`encode_kept_record` (version 2) blob (the whole
    buffer): ascending int64 ids, or a :class:`KeptToRebuild`. ``token_id``: the record's sampled token (for the
    'sampled' form); ``tolerance``: its chunk's. Raises ReplayFormatError."""
    if not 1 <= vocab_size <= MAX_VOCAB:
        raise ValueError(f"vocab_size {vocab_size} outside 1..{MAX_VOCAB}")
    if not (isinstance(tolerance, (int, float)) and math.isfinite(tolerance) and 0 <= tolerance <= MAX_TOLERANCE):
        raise ValueError(f"tolerance {tolerance!r} outside 0..{MAX_TOLERANCE}")
    r = Reader(buf, "kept set")
    version = r.buf[0] >> 4 if r.end else 1
    if version not in (1, 2):
        r.fail(f"kept set of encoding version {version}, this reader knows 1 and 2")
    out = read_kept(r, vocab_size, version, token_id, tolerance)
    if r.pos != r.end:
        r.fail(f"{r.end - r.pos} trailing bytes")
    return out

