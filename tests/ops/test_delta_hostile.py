"""The decoder treats blobs as hostile: every malformed blob raises DeltaError saying what is wrong, never
crashes or writes out of bounds, and leaves the target untouched. Run under AddressSanitizer by
tests/ops/test_asan.py (SYNCD_NATIVE_DIR points the native backend at the sanitized build)."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from syncd.errors import DeltaError
from syncd.ops import _format as fmt
from syncd.ops import delta
from syncd.ops.reference import checksum as ref_ck
from tests.ops._util import perturb, random_bits, reseal, same_bits

FUZZ_EXAMPLES = int(os.environ.get("SYNCD_FUZZ_EXAMPLES", "300"))
DECODERS = ["cpu", "reference"]


def _case(dtype=torch.bfloat16, n=3000, density=0.05, seed=0, block_log2=10, version=1):
    g = torch.Generator().manual_seed(seed)
    old = random_bits((n,), dtype, g)
    new = perturb(old, density, g, max_step=40)
    return old, new, delta.encode(old, new, block_log2=block_log2, version=version)


OLD, NEW, BLOB = _case()
OLD32, NEW32, BLOB32 = _case(torch.float32, n=700, density=0.3, seed=1, block_log2=8)
# dense blocks of ~1200 changes: long enough for the decoder's unchecked fast loop and the apply's dense mode
OLDD, NEWD, BLOBD = _case(n=8192, density=0.3, seed=2, block_log2=12)
# format 2: two context blocks of ~400 changes (bf16, mode 2), a context block of wide values (float32), a mode-0
# one, and two sparse blocks of ~400 changes in 16384 elements (mode 3: row flags; a partial last row)
OLDV2, NEWV2, BLOBV2 = _case(n=8192, density=0.1, seed=3, block_log2=12, version=2)
OLDV2W, NEWV2W, BLOBV2W = _case(torch.float32, n=4096, density=0.3, seed=4, block_log2=12, version=2)
OLDV20, NEWV20, BLOBV20 = _case(n=3000, density=0.05, seed=5, block_log2=10, version=2)
OLDV2R, NEWV2R, BLOBV2R = _case(n=32765, density=0.025, seed=6, block_log2=14, version=2)
V2_CASES = {"context": (OLDV2, NEWV2, BLOBV2), "wide": (OLDV2W, NEWV2W, BLOBV2W), "mode0": (OLDV20, NEWV20, BLOBV20),
            "rows": (OLDV2R, NEWV2R, BLOBV2R)}


def _modes(blob):
    return {blob[off] for off in _context_payloads(blob)}


def test_format_2_cases_cover_every_mode():
    assert delta.inspect(BLOBV2)["context_blocks"] == 2 and delta.inspect(BLOBV2W)["context_blocks"] == 1
    assert delta.inspect(BLOBV20)["context_blocks"] == 0
    assert _modes(BLOBV2) == {fmt.MODE_CONTEXT_BY_DEPTH} and _modes(BLOBV2R) == {fmt.MODE_ROW_FLAGS}
    assert delta.inspect(BLOBV2R)["context_blocks"] == 2


def _apply_expect_error(blob, backend, match=None, old=OLD, verify=True):
    t = old.clone()
    with pytest.raises(DeltaError, match=match):
        delta.apply_(t, blob, backend=backend, verify=verify)
    assert same_bits(t, old), "target changed although apply_ raised"


def _context_payloads(blob):
    """Offsets of the blob's context block payloads."""
    h = fmt.parse_header(blob, ref_ck.checksum_bytes)
    out, off = [], h.header_bytes
    for plen, _, _ in h.blocks:
        if plen and blob[off] in fmt.CONTEXT_MODES:
            out.append(off)
        off += plen
    return out


def _with_block_mode(blob, mode):
    """The blob with every context block's mode byte set to ``mode``, resealed."""
    b = bytearray(blob)
    for off in _context_payloads(blob):
        b[off] = mode
    return reseal(bytes(b))


@pytest.mark.parametrize("backend", DECODERS)
def test_unknown_or_wrong_context_mode(backend):
    """An unknown mode is named; a mode-2 block relabelled mode 1 (its value decisions then read in another
    order) or mode 3 (its parameters then read as row flag probabilities), or a mode-3 block relabelled mode 2,
    fails cleanly, the target kept."""
    _apply_expect_error(_with_block_mode(BLOBV2, 4), backend, match="unknown block mode 4", old=OLDV2)
    _apply_expect_error(_with_block_mode(BLOBV2, fmt.MODE_CONTEXT), backend, old=OLDV2)
    _apply_expect_error(_with_block_mode(BLOBV2, fmt.MODE_ROW_FLAGS), backend, old=OLDV2)
    _apply_expect_error(_with_block_mode(BLOBV2R, fmt.MODE_CONTEXT_BY_DEPTH), backend, old=OLDV2R)


@pytest.mark.parametrize("backend", DECODERS)
def test_truncated_at_every_region(backend):
    for cut in [0, 3, 10, 47, 60, fmt.header_size(1, 3) - 1, fmt.header_size(1, 3) + 5, len(BLOB) - 1]:
        _apply_expect_error(BLOB[:cut], backend, match="truncated|magic")


@pytest.mark.parametrize("backend", DECODERS)
def test_trailing_bytes(backend):
    _apply_expect_error(BLOB + b"\0", backend, match="trailing")


@pytest.mark.parametrize("backend", DECODERS)
def test_bit_flip_in_payload_is_caught_by_its_checksum(backend):
    b = bytearray(BLOB)
    b[-5] ^= 0x10
    _apply_expect_error(bytes(b), backend, match="payload checksum")


@pytest.mark.parametrize("backend", DECODERS)
def test_bit_flip_in_header_is_caught(backend):
    b = bytearray(BLOB)
    b[30] ^= 1  # inside n_changed
    _apply_expect_error(bytes(b), backend, match="header checksum")


@pytest.mark.parametrize("backend", DECODERS)
def test_wrong_magic_and_version(backend):
    _apply_expect_error(b"XXXX" + BLOB[4:], backend, match="magic")
    b = bytearray(BLOB)
    b[4] = 9
    _apply_expect_error(bytes(b), backend, match="version 9")


@pytest.mark.parametrize("backend", DECODERS)
def test_wrong_dtype_shape_and_base(backend):
    _apply_expect_error(BLOB, backend, match="dtype", old=OLD.view(torch.float16))
    _apply_expect_error(BLOB, backend, match="shape", old=OLD[:-1].clone())
    _apply_expect_error(BLOB, backend, match="shape", old=OLD.reshape(1000, 3))
    _apply_expect_error(BLOB, backend, match="wrong base", old=NEW)  # applying the same delta twice
    stale = OLD.clone()
    stale[5] = 1.0
    _apply_expect_error(BLOB, backend, match="wrong base", old=stale)


@pytest.mark.parametrize("backend", DECODERS)
def test_wrong_dtype_and_shape_format_2_name_the_mismatch(backend):
    """A format-2 blob's failure on a target of another dtype or shape names the mismatch: the check for a
    wrong base (run after a format-2 failure) must not read the target by the blob's idea of its size."""
    _apply_expect_error(BLOBV2, backend, match="shape", old=OLDV2[:-1].clone())
    _apply_expect_error(BLOBV2, backend, match="shape", old=OLDV2[:4096].clone())
    _apply_expect_error(BLOBV2, backend, match="dtype", old=OLDV2.view(torch.float16))
    _apply_expect_error(BLOBV2, backend, match="wrong base", old=NEWV2)


@pytest.mark.parametrize("backend", DECODERS)
def test_oversized_claims(backend):
    """Header fields that claim more than the blob or target holds, with valid checksums."""
    b = bytearray(BLOB)
    struct.pack_into("<Q", b, 8, 1 << 60)  # numel
    _apply_expect_error(reseal(bytes(b)), backend, match="exceeds|blocks|shape")
    b = bytearray(BLOB)
    hdr = fmt.HEADER_FIXED.size + 8
    struct.pack_into("<I", b, hdr + 4, 5000)  # block 0 claims more changes than elements
    _apply_expect_error(reseal(bytes(b)), backend, match="claims")
    b = bytearray(BLOB)
    struct.pack_into("<I", b, hdr, 0xFFFFFFF0)  # payload length past the end
    _apply_expect_error(reseal(bytes(b)), backend, match="truncated")


def _resealed_flips_caught(blob, old, new, offsets, backend) -> int:
    """Flip a byte of ``blob`` at each of ``offsets``, reseal every checksum and apply it to a copy of ``old``: how
    many the decoder refused (the copy left as it was); a mutation that still decodes must still yield exactly
    ``new`` (result checksum verified)."""
    caught = 0
    for off in offsets:
        b = bytearray(blob)
        b[off] ^= 0x5A
        t = old.clone()
        try:
            delta.apply_(t, reseal(bytes(b)), backend=backend)
        except DeltaError:
            caught += 1
            assert same_bits(t, old)
        else:
            assert same_bits(t, new)
    return caught


@pytest.mark.parametrize("backend", DECODERS)
def test_resealed_payload_corruption_is_structural_error_not_crash(backend):
    """With checksums recomputed, the entropy decoder's own checks must catch the damage."""
    start = fmt.parse_header(BLOB, ref_ck.checksum_bytes).header_bytes
    assert _resealed_flips_caught(BLOB, OLD, NEW, range(start, min(len(BLOB), start + 120)), backend) > 100


@st.composite
def mutations(draw, blob):
    kind = draw(st.sampled_from(["flip", "truncate", "splice", "overwrite", "extend"]))
    b = bytearray(blob)
    if kind == "flip":
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, len(b) - 1))
            b[i] ^= 1 << draw(st.integers(0, 7))
    elif kind == "truncate":
        b = b[: draw(st.integers(0, len(b) - 1))]
    elif kind == "splice":
        i = draw(st.integers(0, len(b)))
        b[i:i] = draw(st.binary(min_size=1, max_size=16))
    elif kind == "overwrite":
        i = draw(st.integers(0, len(b) - 1))
        chunk = draw(st.binary(min_size=1, max_size=32))
        b[i : i + len(chunk)] = chunk
    else:
        b += draw(st.binary(min_size=1, max_size=64))
    return bytes(b), draw(st.booleans())


def _check_mutation(blob, mutated, resealed, old, new, backend, verify):
    if resealed:
        try:
            mutated = reseal(mutated)
        except (struct.error, ValueError, IndexError, OverflowError):
            pass  # header too damaged to reseal: feed it as is
    t = old.clone()
    try:
        delta.apply_(t, mutated, backend=backend, verify=verify)
    except DeltaError as e:
        assert str(e), "DeltaError without a message"
        assert same_bits(t, old)
        return
    if verify:
        assert same_bits(t, new)


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), verify=st.booleans())
def test_fuzz_native_decoder(data, verify):
    mutated, resealed = data.draw(mutations(BLOB))
    _check_mutation(BLOB, mutated, resealed, OLD, NEW, "cpu", verify)


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), verify=st.booleans())
def test_fuzz_native_decoder_wide_values(data, verify):
    mutated, resealed = data.draw(mutations(BLOB32))
    _check_mutation(BLOB32, mutated, resealed, OLD32, NEW32, "cpu", verify)


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), verify=st.booleans())
def test_fuzz_native_decoder_dense_blocks(data, verify):
    mutated, resealed = data.draw(mutations(BLOBD))
    _check_mutation(BLOBD, mutated, resealed, OLDD, NEWD, "cpu", verify)


@pytest.mark.parametrize("case", sorted(V2_CASES))
@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), verify=st.booleans())
def test_fuzz_native_decoder_format_2(case, data, verify):
    old, new, blob = V2_CASES[case]
    mutated, resealed = data.draw(mutations(blob))
    _check_mutation(blob, mutated, resealed, old, new, "cpu", verify)


@settings(max_examples=max(10, FUZZ_EXAMPLES // 20), deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzz_reference_decoder_format_2(data):
    mutated, resealed = data.draw(mutations(BLOBV2W))
    _check_mutation(BLOBV2W, mutated, resealed, OLDV2W, NEWV2W, "reference", True)


@pytest.mark.parametrize("backend", DECODERS)
@pytest.mark.parametrize("case", ["context", "rows"])
def test_format_2_resealed_corruption_is_a_structural_error(backend, case):
    """With every checksum recomputed, the context decoder's own checks catch damage to its parameters and
    streams (mode 3: its flag probabilities and flag rows too), and the target stays as it was."""
    old, new, blob = V2_CASES[case]
    h = fmt.parse_header(blob, ref_ck.checksum_bytes)
    offsets = list(range(h.header_bytes, h.header_bytes + 90)) + list(range(len(blob) - 30, len(blob)))
    caught = _resealed_flips_caught(blob, old, new, offsets[:: 1 if backend == "cpu" else 6], backend)
    assert caught > (90 if backend == "cpu" else 12)  # of 120 and 20 (the others decode to exactly `new`)


@settings(max_examples=max(20, FUZZ_EXAMPLES // 10), deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzz_reference_decoder(data):
    mutated, resealed = data.draw(mutations(BLOB32))
    _check_mutation(BLOB32, mutated, resealed, OLD32, NEW32, "reference", True)


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(payload=st.binary(min_size=0, max_size=400), nchg=st.integers(0, 300), version=st.sampled_from([1, 2]),
       context=st.booleans())
def test_fuzz_random_payloads_behind_a_valid_header(payload, nchg, version, context):
    """Arbitrary payload bytes behind a well-formed, correctly checksummed header (format 2: often behind
    a context mode byte and plausible group counts, so the parameter and stream checks get exercised)."""
    from syncd.ops.reference import checksum as ck

    if version == 2 and context:
        mode = fmt.CONTEXT_MODES[len(payload) % len(fmt.CONTEXT_MODES)]
        payload = bytes([mode, 0x7F, 0, 1 + payload[:1].hex().count("a") % 4, 1]) + payload
    nchg = nchg if payload else 0
    old = torch.zeros(256, dtype=torch.bfloat16)
    header = fmt.pack_header(fmt.DTYPES["bfloat16"], (256,), 8, [(len(payload), nchg, ck.checksum_bytes(payload))],
                             ck.checksum_bytes(old.view(torch.uint8).numpy()), 0, ck.checksum_bytes, version)
    blob = header + payload
    t = old.clone()
    try:
        delta.apply_(t, blob, backend="cpu", verify=False)
    except DeltaError:
        assert same_bits(t, old)


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(code=st.sampled_from(sorted(fmt.DTYPE_BY_CODE)), nw=st.integers(0, 12), n=st.integers(0, 40),
       seed=st.integers(0, 2**32 - 1), sort=st.booleans())
def test_fuzz_native_changed_words(code, nw, n, seed, sort):
    """The native half of delta.changed_words on arbitrary word lists and change lists (what a hand-made
    Changes could hand it): a result of the right shape, or DeltaError, and never a read or write out of bounds."""
    from syncd.ops import _backend

    rng = np.random.default_rng(seed)
    words = rng.integers(0, 16, nw, dtype=np.uint64)
    pos = rng.integers(0, 64, n, dtype=np.uint64)
    bits = fmt.DTYPE_BY_CODE[code].bits
    if sort:  # well-formed lists half the time: the words are exactly those of the ascending positions
        pos = np.unique(pos)
        words = np.unique(pos // np.uint64(64 // bits)) if seed % 2 else np.unique(words)
    v = rng.integers(0, 2**63, pos.size, dtype=np.uint64) >> rng.integers(bits - 2, 64, pos.size, dtype=np.uint64)
    old_words = rng.integers(0, 2**63, words.size, dtype=np.uint64)
    try:
        old, new, adj = _backend.native().changed_words(code, words, old_words, pos, v)
    except (DeltaError, ValueError):
        return
    assert old.size == new.size == pos.size and old.itemsize == new.itemsize == bits // 8 and 0 <= adj < 2**64
    assert set((pos // (64 // bits)).tolist()) == set(words.tolist())


# ---------------------------------------------------------------------------------- mode 3 (row flags)


def _payloads(blob):
    h = fmt.parse_header(blob, ref_ck.checksum_bytes)
    out, off = [], h.header_bytes
    for plen, _, _ in h.blocks:
        out.append(bytes(blob[off : off + plen]))
        off += plen
    return h, out


def _rebuilt(blob, edit):
    """The blob with ``edit(payload)`` applied to each context payload, its header (lengths, checksums) redone."""
    h, payloads = _payloads(blob)
    payloads = [edit(p) if p and p[0] in fmt.CONTEXT_MODES else p for p in payloads]
    table = [(len(p), n, ref_ck.checksum_bytes(p) if p else 0) for p, (_, n, _) in zip(payloads, h.blocks)]
    return fmt.pack_header(h.dtype, h.shape, h.block_log2, table, h.base_checksum, h.new_checksum,
                           ref_ck.checksum_bytes, 2) + b"".join(payloads)


def _flag_table_at(payload: bytes) -> int:
    """Offset of a mode-3 payload's row context mask (after the mode, e_top, group counts and class list)."""
    (mask_p,) = struct.unpack_from("<H", payload, fmt.CONTEXT_FIXED.size)
    return fmt.CONTEXT_FIXED.size + 2 + 2 * bin(mask_p).count("1")


@pytest.mark.parametrize("backend", DECODERS)
def test_mode_3_zero_flag_probability_and_foreign_row_contexts(backend):
    def zero_first(p):
        at = _flag_table_at(p) + 2
        return p[:at] + b"\0\0" + p[at + 2 :]
    _apply_expect_error(_rebuilt(BLOBV2R, zero_first), backend, match="zero flag probability", old=OLDV2R)

    def drop_table(p):  # no flag probabilities listed: no row is coded, no change is found
        at = _flag_table_at(p)
        (mask_r,) = struct.unpack_from("<H", p, at)
        return p[:at] + b"\0\0" + p[at + 2 + 2 * bin(mask_r).count("1") :]
    _apply_expect_error(_rebuilt(BLOBV2R, drop_table), backend, old=OLDV2R)


@pytest.mark.parametrize("backend", DECODERS)
def test_mode_3_row_contexts_of_an_integer_dtype(backend, monkeypatch):
    """Integer dtypes have one class, so one row context: a block listing another is refused by name."""
    from syncd.ops.reference import delta_v2

    g = torch.Generator().manual_seed(9)
    old = random_bits((16384,), torch.int16, g)
    new = perturb(old, 0.02, g, max_step=40)
    monkeypatch.setattr(delta_v2, "use_context", lambda n, span, dt: n >= 256 and span >= 4096)
    blob = delta.encode(old, new, backend="reference", block_log2=14, version=2)
    monkeypatch.undo()
    assert _modes(blob) == {fmt.MODE_ROW_FLAGS}
    for be in DECODERS:
        assert same_bits(delta.decode(old, blob, backend=be), new), be

    def second_context(p):
        at = _flag_table_at(p)
        (mask_r,) = struct.unpack_from("<H", p, at)
        assert mask_r == 1
        return p[:at] + struct.pack("<HHH", 3, *struct.unpack_from("<H", p, at + 2), 1000) + p[at + 4 :]
    _apply_expect_error(_rebuilt(blob, second_context), backend, match="row contexts other than 0", old=old)


def _blob_with_extra_flags(extra: int):
    """BLOBV2R re-encoded by the reference with ``extra`` more rows flagged than have a change (each coded with
    its chain probabilities and no change, as a decoder that finds none would read it)."""
    from syncd.ops.reference import binary_rans as br
    from syncd.ops.reference import rows as rf

    def encode_positions(classes, p1, pa, groups, changed):
        contexts, flags = rf.row_contexts(classes), rf.changed_rows(changed)
        quiet = [t for t in range(flags.size) if not flags[t] and pa[contexts[t]]][:extra]
        flags[quiet] = True
        steps = []
        for u in range((contexts.size + fmt.LANES - 1) // fmt.LANES):
            t = u * fmt.LANES + np.arange(fmt.LANES)
            exists = t < contexts.size
            pr = np.where(exists, pa[contexts[np.minimum(t, contexts.size - 1)]], 0)
            hit = flags[np.minimum(t, contexts.size - 1)] & (pr > 0)
            steps.append((pr > 0, pr, hit))
            for row in t[hit].tolist():
                lo, hi = row * fmt.LANES, min(classes.size, (row + 1) * fmt.LANES)
                p = np.zeros(fmt.LANES, np.int64)
                p[: hi - lo] = p1[classes[lo:hi].astype(np.int64)]
                q = rf.chain_probabilities(p)
                bits = np.zeros(fmt.LANES, bool)
                bits[: hi - lo] = changed[lo:hi]
                first = int(np.argmax(bits)) if bits.any() else fmt.LANES
                steps.append((p > 0, np.where(np.arange(fmt.LANES) <= first, q, p), bits))
        return [br.encode_group(steps[g::groups]) for g in range(groups)]

    orig = rf.encode_positions
    rf.encode_positions = encode_positions
    try:
        return delta.encode(OLDV2R, NEWV2R, backend="reference", block_log2=14, version=2)
    finally:
        rf.encode_positions = orig


@pytest.mark.parametrize("backend", DECODERS)
def test_mode_3_flagged_rows_must_have_a_change(backend):
    """A flag must mean a change: a flagged row that decodes none is refused by name (the streams themselves are
    well formed), and a block table claiming fewer changes than the rows flagged stops the decode (which holds
    a copy of each flagged row) as soon as either count passes it; the target kept."""
    assert _blob_with_extra_flags(0) == BLOBV2R  # the helper codes what the encoders do
    _apply_expect_error(_blob_with_extra_flags(1), backend, match="has no change", old=OLDV2R)
    h, payloads = _payloads(BLOBV2R)
    table = []
    for i, (p, (_, n, _)) in enumerate(zip(payloads, h.blocks)):
        if i == 0:  # claim a third of the changes: the sign bytes shrink to match
            n //= 3
            p = p[: len(p) - (h.blocks[0][1] + 7) // 8] + b"\0" * ((n + 7) // 8)
            payloads[0] = p
        table.append((len(p), n, ref_ck.checksum_bytes(p)))
    few = fmt.pack_header(h.dtype, h.shape, h.block_log2, table, h.base_checksum, h.new_checksum,
                          ref_ck.checksum_bytes, 2) + b"".join(payloads)
    _apply_expect_error(few, backend, match="rows flagged, more than|more changes than", old=OLDV2R)
