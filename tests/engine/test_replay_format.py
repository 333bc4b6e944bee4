"""Replay encodings (kept sets, routing, chunks): round trips, compactness, and hostile input (hypothesis)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.replay.format import (ReplayChunk, ReplayFormatError, TokenRecord, decode_chunk, decode_kept,
                                  encode_chunk, encode_kept, pack_routing, unpack_routing)

EXAMPLES = int(os.environ.get("SYNCD_FUZZ_EXAMPLES", "300"))
fuzz = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def kept_sets(draw):
    vocab = draw(st.integers(1, 3000))
    ids = draw(st.sets(st.integers(0, vocab - 1), min_size=1, max_size=min(vocab, 400)))
    if draw(st.booleans()) and vocab <= 400:
        ids = set(range(vocab))
    return vocab, np.array(sorted(ids), dtype=np.int64)


@fuzz
@given(kept_sets())
def test_kept_sets_round_trip_in_the_smallest_form(case):
    vocab, ids = case
    blob = encode_kept(ids[::-1], vocab)
    assert np.array_equal(decode_kept(blob, vocab), ids)
    assert len(blob) <= 1 + (vocab + 7) // 8  # never more than the bitmap
    if ids.size == vocab:
        assert len(blob) == 1


def test_kept_set_forms():
    assert encode_kept([5], 100_000)[0] == 0x10 and len(encode_kept([5], 100_000)) == 3
    dense = np.arange(0, 1000, 2)
    assert encode_kept(dense, 1000)[0] == 0x11  # bitmap beats 500 varints
    with pytest.raises(ValueError, match="outside"):
        encode_kept([1000], 1000)
    with pytest.raises(ValueError, match="repeat"):
        encode_kept([3, 3], 10)
    with pytest.raises(ValueError, match="at least one"):
        encode_kept([], 10)


@pytest.mark.parametrize("blob, vocab, msg", [
    (b"", 10, "truncated"),
    (b"\x20", 10, "encoding version 2"),
    (b"\x13", 10, "unknown kept-set form 3"),
    (b"\x10\x00", 10, "empty kept set"),
    (b"\x10\x02\x05\x09", 10, "outside the vocabulary"),
    (b"\x10\x01\x0a", 10, "exceeds its bound"),
    (b"\x11\xff\x07", 10, "past the vocabulary"),
    (b"\x11\x00\x00", 10, "empty kept set"),
    (b"\x12\x00", 10, "trailing"),
    (b"\x10\x01" + b"\x80" * 11, 10, "longer than 10 bytes"),
])
def test_corrupt_kept_sets_raise_clear_errors(blob, vocab, msg):
    with pytest.raises(ReplayFormatError, match=msg):
        decode_kept(blob, vocab)


@st.composite
def routings(draw):
    E = draw(st.integers(1, 300))
    n, L, k = draw(st.integers(0, 20)), draw(st.integers(0, 6)), draw(st.integers(1, 4))
    ids = draw(st.lists(st.integers(0, E - 1), min_size=n * L * k, max_size=n * L * k))
    return E, np.array(ids, dtype=np.int64).reshape(n, L, k)


@fuzz
@given(routings())
def test_routing_round_trips_bit_packed(case):
    E, ids = case
    blob = pack_routing(ids, E)
    got, experts = unpack_routing(blob)
    assert experts == E and got.shape == ids.shape and np.array_equal(got, ids)
    bits = max(1, (E - 1).bit_length())
    assert len(blob) <= 1 + 4 * 3 + 5 + (ids.size * bits + 7) // 8


def test_routing_bounds():
    with pytest.raises(ValueError, match="outside"):
        pack_routing(np.full((1, 2, 2), 8), 8)
    blob = bytearray(pack_routing(np.full((1, 1, 1), 5), 6))  # 3 bits: 0b101
    blob[-1] = 0b111  # id 7 >= 6 experts
    with pytest.raises(ReplayFormatError, match="outside 0..5"):
        unpack_routing(bytes(blob))
    blob[-1] = 0b1000_0101  # a padding bit set
    with pytest.raises(ReplayFormatError, match="padding"):
        unpack_routing(bytes(blob))
    with pytest.raises(ReplayFormatError, match="truncated"):
        unpack_routing(pack_routing(np.zeros((9, 2, 2)), 16)[:-1])


def _chunk(n=5, routing=True, vocab=320, experts=8, version_at=(3, 4)) -> ReplayChunk:
    g = np.random.default_rng(n)
    recs = []
    for i in range(n):
        kept = np.sort(g.choice(vocab, size=int(g.integers(1, 40)), replace=False))
        recs.append(TokenRecord(10 + i, i, version_at[0] if i < 2 else version_at[1], int(kept[0]),
                                float(-g.random()), kept,
                                g.integers(0, experts, size=(2, 2)) if routing else None))
    pr = g.integers(0, experts, size=(9, 2, 2)) if routing else None
    return ReplayChunk("req-1/é", vocab, recs, experts if routing else 0, 1, pr)


@pytest.mark.parametrize("routing", [True, False])
def test_chunks_round_trip(routing):
    c = _chunk(routing=routing)
    d = decode_chunk(encode_chunk(c))
    assert d.request_id == c.request_id and d.vocab_size == c.vocab_size and d.num_experts == c.num_experts
    for a, b in zip(c.records, d.records):
        assert (a.position, a.index, a.version, a.token_id) == (b.position, b.index, b.version, b.token_id)
        assert np.float32(a.logprob) == b.logprob and np.array_equal(a.kept, b.kept)
        assert (a.routing is None and b.routing is None) or np.array_equal(a.routing, b.routing)
    if routing:
        assert d.prompt_routing_start == 1 and np.array_equal(d.prompt_routing, c.prompt_routing)
    none_version = _chunk(routing=False, version_at=(None, 0))
    assert [r.version for r in decode_chunk(encode_chunk(none_version)).records] == [None, None, 0, 0, 0]


def test_chunk_encoder_refuses_inconsistent_records():
    c = _chunk()
    c.records[2].position += 1
    with pytest.raises(ValueError, match="consecutive"):
        encode_chunk(c)


@fuzz
@given(st.data())
def test_corrupted_chunks_raise_replay_format_errors(data):
    blob = bytearray(encode_chunk(_chunk(n=data.draw(st.integers(1, 6)), routing=data.draw(st.booleans()))))
    how = data.draw(st.sampled_from(["flip", "truncate", "extend", "garbage"]))
    if how == "flip":
        i = data.draw(st.integers(0, len(blob) - 1))
        blob[i] ^= 1 << data.draw(st.integers(0, 7))
    elif how == "truncate":
        del blob[data.draw(st.integers(0, len(blob) - 1)):]
    elif how == "extend":
        blob += data.draw(st.binary(min_size=1, max_size=8))
    else:
        blob = bytearray(b"SRPL" + data.draw(st.binary(max_size=200)))
    with pytest.raises(ReplayFormatError):
        decode_chunk(bytes(blob))


@fuzz
@given(st.binary(max_size=64), st.integers(1, 5000))
def test_random_bytes_never_crash_the_set_and_routing_decoders(blob, vocab):
    for fn in (lambda: decode_kept(blob, vocab), lambda: unpack_routing(blob)):
        try:
            fn()
        except ReplayFormatError:
            pass


def test_chunk_decoder_checks_structure_behind_a_valid_checksum():
    """A chunk whose checksum was recomputed over wrong content (a buggy or hostile writer) is still refused."""
    import struct

    from syncd.ops import checksum_bytes

    good = encode_chunk(_chunk(routing=False))
    body = bytearray(good[:-8])
    body[4] = 9  # format version 9
    with pytest.raises(ReplayFormatError, match="format version 9"):
        decode_chunk(bytes(body) + struct.pack("<Q", checksum_bytes(bytes(body))))
    body = bytearray(good[:-8]) + b"\x00"
    with pytest.raises(ReplayFormatError, match="trailing"):
        decode_chunk(bytes(body) + struct.pack("<Q", checksum_bytes(bytes(body))))
