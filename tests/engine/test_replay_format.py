"""Replay encodings (kept sets, routing, chunks): round trips, compactness, and hostile input (hypothesis); format-1
chunks (written by the previous release) still read. Kept sets to rebuild: ``tests/engine/test_replay_kept.py``."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.replay.format import (ReplayChunk, ReplayFormatError, TokenRecord, decode_chunk, decode_kept,
                                  encode_chunk, encode_kept, pack_routing, unpack_routing)
from syncd.ops.replay import kept_fingerprint
from syncd.records.replay import KeptToRebuild

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
    (b"\x30", 10, "encoding version 3"),
    (b"\x23", 10, "needs its record's token id"),
    (b"\x24\x01\x00\x00\x00\x00", 10, "states no tolerance"),
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


def _chunk(n=5, routing=True, vocab=320, experts=8, version_at=(3, 4), tolerance=1e-3) -> ReplayChunk:
    """Records with kept sets in rank order and margins (every other one robust enough to be written to rebuild)."""
    g = np.random.default_rng(n)
    recs = []
    for i in range(n):
        kept = g.choice(vocab, size=int(g.integers(1, 40)), replace=False)
        margins = np.where(np.arange(kept.size) % 2 == i % 2, 1.0, 1e-4) if i % 3 else None
        recs.append(TokenRecord(10 + i, i, version_at[0] if i < 2 else version_at[1], int(kept[0]),
                                float(-g.random()), kept, g.integers(0, experts, size=(2, 2)) if routing else None,
                                margins))
    pr = g.integers(0, experts, size=(9, 2, 2)) if routing else None
    return ReplayChunk("req-1/é", vocab, recs, experts if routing else 0, 1, pr, tolerance)


def _same_kept(written: TokenRecord, read, vocab: int) -> bool:
    ids = np.sort(np.asarray(written.kept))
    if not isinstance(read, KeptToRebuild):
        return np.array_equal(read, ids)
    ranked = np.asarray(written.kept)
    fp = int(kept_fingerprint(torch.from_numpy(ids), torch.tensor([0, ids.size]))[0])
    return read.size == ids.size and np.array_equal(read.extra, np.sort(ranked[read.top:])) and \
        read.fingerprint == fp and np.all(written.kept_margins[read.top - 1] > 2e-3)


@pytest.mark.parametrize("routing", [True, False])
def test_chunks_round_trip(routing):
    c = _chunk(n=9, routing=routing)
    d = decode_chunk(encode_chunk(c))
    assert d.request_id == c.request_id and d.vocab_size == c.vocab_size and d.num_experts == c.num_experts
    assert d.kept_tolerance == np.float32(1e-3)
    for a, b in zip(c.records, d.records):
        assert (a.position, a.index, a.version, a.token_id) == (b.position, b.index, b.version, b.token_id)
        assert np.float32(a.logprob) == b.logprob and _same_kept(a, b.kept, c.vocab_size)
        assert (a.routing is None and b.routing is None) or np.array_equal(a.routing, b.routing)
    assert any(isinstance(r.kept, KeptToRebuild) for r in d.records)
    assert any(not isinstance(r.kept, KeptToRebuild) for r in d.records)
    again = decode_chunk(encode_chunk(d))  # a read chunk written back (sets to rebuild as they were)
    assert encode_chunk(again) == encode_chunk(d)
    if routing:
        assert d.prompt_routing_start == 1 and np.array_equal(d.prompt_routing, c.prompt_routing)
    none_version = _chunk(routing=False, version_at=(None, 0))
    assert [r.version for r in decode_chunk(encode_chunk(none_version)).records] == [None, None, 0, 0, 0]
    listed = _chunk(n=9, routing=routing, tolerance=0.0)  # no tolerance stated: every set listed
    assert all(not isinstance(r.kept, KeptToRebuild) for r in decode_chunk(encode_chunk(listed)).records)


# format 1, as the previous release wrote it (encode_chunk of issue 16): MoE with prompt routing; dense, V 151,936
OLD_MOE = bytes.fromhex(
    "5352504c0103077265712d6f6c64c0020a00030203020401ae028902820200000080000080be000000bf1001ae0210041135ad0113100925032e"
    "070b265212081008020203ed79ccb70b011008020203d417c70406f13c5f91eaefa10b")
OLD_DENSE = bytes.fromhex(
    "5352504c01000d7265712d6f6c642d64656e736580a309050002020001010107f09309000000bf000080bf100107100303ec93090068708bc8dc"
    "4e1a24")


def test_format_1_chunks_still_read():
    c = decode_chunk(OLD_MOE)
    assert c.request_id == "req-old" and c.vocab_size == 320 and c.num_experts == 8 and c.kept_tolerance == 0
    assert [r.kept.tolist() for r in c.records] == [[302], [17, 71, 245, 265],
                                                    [37, 41, 88, 96, 108, 147, 230, 249, 258]]
    assert [(r.position, r.index, r.version, r.token_id) for r in c.records] == [(10, 0, 2, 302), (11, 1, 2, 265),
                                                                                (12, 2, 3, 258)]
    assert [r.routing.tolist() for r in c.records] == [[[5, 5], [7, 4]], [[7, 0], [3, 6]], [[7, 6], [6, 5]]]
    assert c.prompt_routing_start == 1 and c.prompt_routing.tolist() == [[[4, 2], [7, 3]], [[1, 6], [1, 6]],
                                                                         [[4, 0], [0, 3]]]
    d = decode_chunk(OLD_DENSE)
    assert [r.version for r in d.records] == [None, 0] and [r.kept.tolist() for r in d.records] == [[7], [3, 150000,
                                                                                                     150001]]
    assert encode_chunk(c, version=1) == OLD_MOE and encode_chunk(d, version=1) == OLD_DENSE  # the writer kept too
    # format 2: + the tolerance (float32); the singleton {7} is its record's token, one byte instead of three
    assert len(encode_chunk(d)) == len(OLD_DENSE) + 4 - 2
    with pytest.raises(ValueError, match="explicit kept sets only"):
        encode_chunk(decode_chunk(encode_chunk(_chunk(n=9))), version=1)
    v1_with_v2_set = bytearray(OLD_DENSE[:-8])
    v1_with_v2_set[v1_with_v2_set.index(b"\x10\x01\x07")] = 0x23  # a format-2 form inside a format-1 chunk
    with pytest.raises(ReplayFormatError, match="encoding version 2 in a format-1 chunk"):
        decode_chunk(_with_checksum(bytes(v1_with_v2_set)))


def _with_checksum(body: bytes) -> bytes:
    import struct

    from syncd.ops import checksum_bytes

    return body + struct.pack("<Q", checksum_bytes(body))


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
    for fn in (lambda: decode_kept(blob, vocab), lambda: unpack_routing(blob),
               lambda: decode_kept(blob, vocab, token_id=0, tolerance=1e-3), lambda: decode_kept(b"\x24" + blob, vocab,
                                                                                               tolerance=1e-3),
               lambda: decode_kept(b"\x25" + blob, vocab, tolerance=1e-3)):
        try:
            fn()
        except ReplayFormatError:
            pass


def test_chunk_decoder_checks_structure_behind_a_valid_checksum():
    """A chunk whose checksum was recomputed over wrong content (a buggy or hostile writer) is still refused."""
    good = encode_chunk(_chunk(routing=False))
    body = bytearray(good[:-8])
    body[4] = 9  # format version 9
    with pytest.raises(ReplayFormatError, match="format version 9"):
        decode_chunk(_with_checksum(bytes(body)))
    body = bytearray(good[:-8]) + b"\x00"
    with pytest.raises(ReplayFormatError, match="trailing"):
        decode_chunk(_with_checksum(bytes(body)))
    at = good.index(b"req-1/\xc3\xa9") + len("req-1/é".encode()) + 2  # after the vocabulary's varint: the tolerance
    for bad in (float("nan"), float("inf"), -1.0, 1e9):
        body = bytearray(good[:-8])
        body[at:at + 4] = np.float32(bad).tobytes()
        with pytest.raises(ReplayFormatError, match="kept tolerance"):
            decode_chunk(_with_checksum(bytes(body)))


def test_a_chunk_of_whole_vocabulary_sets_at_the_largest_vocabulary_stays_small():
    """The 'all' form is one byte per record: decoding many of them at V = 2**26 (the reader's bound) shares one
    read-only id array instead of allocating 512 MiB per record (a hostile 1 KB chunk asked for ~85 GB)."""
    import tracemalloc

    from syncd.records.replay_kept import MAX_VOCAB

    vocab, n = MAX_VOCAB, 400
    tracemalloc.start()
    one = decode_kept(b"\x12", vocab)
    for _ in range(n):
        assert decode_kept(b"\x12", vocab) is one
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert one.size == vocab and not one.flags.writeable
    assert peak < 2 * 8 * vocab  # one array, not one per record
