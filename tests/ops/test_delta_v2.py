"""Format 2: round trips, byte-identical blobs from every encoder, context blocks needing the base, the
encoders' choices (mode, e_top, probabilities) against the reference, and the GPU backends' context path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from syncd.errors import DeltaError
from syncd.ops import _context, checksum, delta
from syncd.ops import _format as fmt
from syncd.ops.reference import checksum as ref_ck
from syncd.ops.reference import context as ref_ctx
from tests.ops._util import ALL_DTYPES, on, perturb, random_bits, same_bits

CPU_BACKENDS = ["cpu", "reference", "triton"]  # triton runs interpreted on CPU tensors in CI


def weight_pair(n: int, step: float, seed: int = 0, dtype=torch.bfloat16):
    """Weight-like values (normal, std 0.02) and the same after an Adam-like step of +-``step``: small
    weights change more often and by more ulps, as in real deltas."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=g) * 0.02
    moved = w + torch.randn(n, generator=g).sign() * step * (0.5 + torch.rand(n, generator=g))
    return w.to(dtype), moved.to(dtype)


def mode_1_blob(old, new, block_log2=16):
    """The blob an encoder wrote before mode 2 existed (context blocks in mode 1: J in position order), from
    the reference told so."""
    import functools

    from syncd.ops.reference import delta_v2

    orig = delta_v2.encode_block
    delta_v2.encode_block = functools.partial(orig, mode=fmt.MODE_CONTEXT)
    try:
        return delta.encode(old, new, version=2, block_log2=block_log2, backend="reference")
    finally:
        delta_v2.encode_block = orig


def forced_mode_blob(old, new, mode, block_log2=16):
    """The blob the reference writes with every context block in ``mode`` (1 and 2: as encoders did before
    mode 2 and mode 3 existed)."""
    import functools

    from syncd.ops.reference import delta_v2

    orig = delta_v2.encode_block
    delta_v2.encode_block = functools.partial(orig, mode=mode)
    try:
        return delta.encode(old, new, version=2, block_log2=block_log2, backend="reference")
    finally:
        delta_v2.encode_block = orig


def block_modes(blob) -> list[int]:
    """The mode byte of each block payload of a format-2 blob (-1 for a block without changes)."""
    h = fmt.parse_header(blob, ref_ck.checksum_bytes)
    out, off = [], h.header_bytes
    for plen, _, _ in h.blocks:
        out.append(blob[off] if plen else -1)
        off += plen
    return out


def _pair(shape, dtype, density, seed):
    g = torch.Generator().manual_seed(seed)
    old = random_bits(shape, dtype, g)
    return old, perturb(old, density, g, max_step=40)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (7,), (1000, 3), (9000,)], ids=str)
def test_round_trip_every_dtype_and_shape(dtype, shape):
    old, new = _pair(shape, dtype, 0.2, seed=hash((str(dtype), shape)) % 1000)
    blob = delta.encode(old, new, backend="cpu", block_log2=13, version=2)
    info = delta.inspect(blob)
    assert info["format_version"] == 2
    context = old.numel() >= 8192 and dtype.is_floating_point and dtype.itemsize >= 2
    assert info["context_blocks"] == (1 if context else 0)
    assert sum(info["sections"].values()) == info["payload_bytes"]
    for be in ("cpu", "reference"):
        assert same_bits(delta.decode(old, blob, backend=be), new), be
    assert info["base_checksum"] == checksum(old) and info["new_checksum"] == checksum(new)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_backends_write_identical_blobs_and_read_each_other(dtype):
    old, new = _pair((9000,), dtype, 0.1, seed=7)
    blobs = {b: delta.encode(on(old, b), on(new, b), backend=b, block_log2=12, version=2) for b in CPU_BACKENDS}
    assert blobs["cpu"] == blobs["reference"] == blobs["triton"]
    # blocks of 4096 with ~400 changes each; integer dtypes have no exponent to model on, 8-bit floats stay mode 0
    assert delta.inspect(blobs["cpu"])["context_blocks"] == (2 if dtype.is_floating_point and dtype.itemsize > 1 else 0)
    for b in CPU_BACKENDS:
        t = on(old.clone(), b)
        delta.apply_(t, blobs["cpu"], backend=b)
        assert same_bits(t, new), b


def test_weight_like_deltas_beat_format_1():
    old, new = weight_pair(1 << 18, 1e-5)
    v1, v2 = delta.encode(old, new), delta.encode(old, new, version=2)
    assert len(v2) < 0.85 * len(v1)
    assert same_bits(delta.decode(old, v2), new)
    assert delta.encode(old, new, version=2, backend="reference") == v2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_every_bit_pattern_round_trips(dtype, monkeypatch):
    """Every value, including -0.0, each NaN payload, +-inf and subnormals, as old and as new, in context
    blocks (whose classes come from the old exponents, NaN and inf included). Encoders keep 8-bit floats in
    mode 0: those blobs come from the reference told otherwise."""
    from syncd.ops.reference import delta_v2

    bits = 8 * torch.empty((), dtype=dtype).element_size()
    allv = (torch.arange(2**bits, dtype=torch.int32).to(torch.int16) if bits == 16
            else torch.arange(256, dtype=torch.int32).to(torch.uint8)).repeat(1 if bits == 16 else 32)
    old = allv.view(dtype)
    g = torch.Generator().manual_seed(1)
    new = old[torch.randperm(old.numel(), generator=g)]
    encoder = "auto"
    if bits == 8:
        monkeypatch.setattr(delta_v2, "use_context", lambda n, span, dt: n >= 256 and span >= 4096)
        encoder = "reference"
    blob = delta.encode(old, new, version=2, backend=encoder)
    assert delta.inspect(blob)["context_blocks"] >= 1
    assert same_bits(delta.decode(old, blob), new)
    back = delta.encode(new, old, version=2, backend=encoder)
    assert same_bits(delta.decode(new, back, backend="reference"), old)
    assert same_bits(delta.decode(new, back, backend="cpu"), old)


def test_value_order_of_mode_2_is_by_tree_depth_then_position():
    from syncd.ops.reference import delta_v2

    depth = np.zeros(fmt.CLASSES, np.int64)
    depth[[3, 5, 9]] = [2, 1, 4]
    cls_j = np.array([3, 5, 9, 5, 3, 9, 5])
    assert delta_v2.value_order(cls_j, depth, fmt.MODE_CONTEXT).tolist() == list(range(7))
    assert delta_v2.value_order(cls_j, depth, fmt.MODE_CONTEXT_BY_DEPTH).tolist() == [1, 3, 6, 0, 4, 2, 5]


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_encoders_write_mode_2_and_blobs_in_mode_1_still_decode(backend):
    """Mode 2 codes the same decisions as mode 1 in another order: same changes, about the same bytes; a
    blob written in mode 1 (before mode 2 existed) decodes on every backend."""
    old, new = weight_pair(1 << 17, 3e-5, seed=4)  # dense: classes with value trees of 1 to 4 levels
    blob2 = delta.encode(old, new, version=2, block_log2=16, backend=backend)
    blob1 = mode_1_blob(old, new)
    assert set(block_modes(blob2)) == {fmt.MODE_CONTEXT_BY_DEPTH}
    assert set(block_modes(blob1)) == {fmt.MODE_CONTEXT}
    assert blob1 != blob2 and abs(len(blob1) - len(blob2)) < 0.01 * len(blob1)
    assert delta.inspect(blob1)["context_blocks"] == delta.inspect(blob2)["context_blocks"] == 2
    for blob in (blob1, blob2):
        assert same_bits(delta.decode(old, blob, backend=backend), new)
        t = old.clone()
        delta.apply_(t, blob, backend=backend)
        assert same_bits(t, new)


def test_small_or_sparse_blocks_are_mode_0_and_need_no_base():
    old, new = weight_pair(3000, 1e-5)  # one block of 3000 elements: below the context span
    blob = delta.encode(old, new, version=2)
    assert delta.inspect(blob)["context_blocks"] == 0 and not delta.needs_base(blob)
    c = delta.changes(blob)  # no base needed
    assert torch.equal(c.positions, delta.changes(delta.encode(old, new)).positions)


def test_context_blocks_need_the_base():
    old, new = weight_pair(1 << 16, 1e-5)
    blob = delta.encode(old, new, version=2)
    assert delta.needs_base(blob) and not delta.needs_base(delta.encode(old, new))
    with pytest.raises(DeltaError):
        delta.needs_base(blob[:40])
    with pytest.raises(DeltaError, match="needs the base"):
        delta.changes(blob)
    c1, c2 = delta.changes(delta.encode(old, new)), delta.changes(blob, base=old)
    assert torch.equal(c1.positions, c2.positions) and torch.equal(c1.values, c2.values)
    assert (c2.base_checksum, c2.new_checksum) == (c1.base_checksum, c1.new_checksum)
    with pytest.raises(DeltaError, match="base is"):
        delta.changes(blob, base=old[:-1])


def test_changes_from_the_base_classes_alone_match_changes_from_the_base():
    """``base_classes`` (what a GPU holding the base computes; here on the CPU) is all ``changes`` needs of the
    base: the same change list; a blob without a context block needs none; classes of another length or dtype
    are refused by name."""
    old, new = weight_pair((1 << 16) + 3, 1e-5)
    blob = delta.encode(old, new, version=2, block_log2=14)
    cls = delta.base_classes(blob, old)
    assert cls.dtype == torch.uint8 and cls.numel() == (old.numel() + 1) // 2
    c1, c2 = delta.changes(blob, base=old), delta.changes(blob, classes=cls)
    assert torch.equal(c1.positions, c2.positions) and torch.equal(c1.values, c2.values)
    assert (c1.base_checksum, c1.new_checksum) == (c2.base_checksum, c2.new_checksum)
    assert delta.base_classes(delta.encode(old, new), old) is None
    for bad in (cls[:-1], cls.to(torch.int16), cls.view(1, -1)):
        with pytest.raises(DeltaError, match=r"classes must be a 1-D uint8 tensor of 32770 bytes \(base_classes\)"):
            delta.changes(blob, classes=bad)
    with pytest.raises(DeltaError, match="base is"):
        delta.base_classes(blob, old[:-1])
    wrong = delta.base_classes(blob, old * 4)  # another tensor's classes: the decode fails, it does not guess
    with pytest.raises(DeltaError):
        delta.changes(blob, classes=wrong)


@pytest.mark.parametrize("step", [3e-7, 3e-6, 1e-2])  # about 1%, 10% and every element changed
def test_changes_list_every_change_in_order_at_any_density(step):
    """The context blocks' change lists (positions from the bitmap, 64 elements a step, and a partial end) are
    format 1's, from sparse to every element changed."""
    old, new = weight_pair((3 << 16) + 37, step)
    blob = delta.encode(old, new, version=2, block_log2=16)
    assert delta.inspect(blob)["context_blocks"] > 0
    c1, c2 = delta.changes(delta.encode(old, new)), delta.changes(blob, base=old)
    assert torch.equal(c1.positions, c2.positions) and torch.equal(c1.values, c2.values)
    assert torch.equal(c2.positions, torch.nonzero(old.view(torch.int16) != new.view(torch.int16)).view(-1))


def test_apply_with_the_wrong_base_fails_cleanly():
    old, new = weight_pair(1 << 16, 1e-5)
    blob = delta.encode(old, new, version=2)
    for be in ("cpu", "reference"):
        t = new.clone()  # the same delta twice: its classes differ from the encoder's
        with pytest.raises(DeltaError):
            delta.apply_(t, blob, backend=be)
        assert same_bits(t, new)
        t = new.clone()  # without the checksums the decoder must still not write out of bounds or raise oddly
        try:
            delta.apply_(t, blob, backend=be, verify=False)
        except DeltaError:
            assert same_bits(t, new)


def test_many_matches_one_by_one():
    pairs = [weight_pair(n, 1e-5, seed=n) for n in (5, 3000, 70_000, 300_000)]
    olds, news = [p[0] for p in pairs], [p[1] for p in pairs]
    blobs = delta.encode_many(olds, news, block_log2=16, version=2)
    assert blobs == [delta.encode(o, n, block_log2=16, version=2) for o, n in zip(olds, news)]
    work = [o.clone() for o in olds]
    delta.apply_many(work, blobs)
    assert all(same_bits(w, n) for w, n in zip(work, news))
    bad = list(blobs)
    bad[3] = bad[3][:-3]
    work = [o.clone() for o in olds]
    with pytest.raises(DeltaError, match="truncated"):
        delta.apply_many(work, bad)
    assert same_bits(work[3], olds[3]) and all(same_bits(work[i], news[i]) for i in range(3))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int16], ids=str)
def test_undo_after_a_later_block_fails(dtype):
    """A tensor whose last block is corrupt (resealed, so only the decoder can tell) comes back unchanged
    although its first blocks were written: context blocks are undone from the changes decoded before they
    were written, mode-0 blocks (every block of an integer dtype) by decoding them again, as in format 1."""
    from tests.ops._util import reseal

    old, new = weight_pair(1 << 16, 1e-5) if dtype == torch.bfloat16 else _pair((1 << 16,), dtype, 0.05, seed=5)
    blob = bytearray(delta.encode(old, new, block_log2=14, version=2))
    assert (delta.inspect(bytes(blob))["context_blocks"] > 0) == (dtype == torch.bfloat16)
    blob[-20] ^= 0x55
    t = old.clone()
    with pytest.raises(DeltaError):
        delta.apply_(t, reseal(bytes(blob)))
    assert same_bits(t, old)


@pytest.mark.parametrize("dtype", [torch.int16, torch.uint8, torch.int32, torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=str)
def test_context_blocks_of_integer_and_8_bit_dtypes_decode(dtype, monkeypatch):
    """Encoders write integer and 8-bit float dtypes in mode 0, but the format allows mode 1 (integers with a
    single class): a blob the reference writes that way decodes the same on every decoder."""
    from syncd.ops.reference import delta_v2

    old, new = _pair((9000,), dtype, 0.2, seed=3)
    monkeypatch.setattr(delta_v2, "use_context", lambda n, span, dt: n >= 256 and span >= 4096)
    blob = delta.encode(old, new, backend="reference", block_log2=13, version=2)
    monkeypatch.undo()
    assert delta.inspect(blob)["context_blocks"] == 1
    for be in ("cpu", "reference"):
        assert same_bits(delta.decode(old, blob, backend=be), new), be


def test_unknown_version_is_refused():
    a = torch.zeros(4, dtype=torch.bfloat16)
    with pytest.raises(DeltaError, match="version"):
        delta.encode(a, a, version=3)


# ---------------------------------------------------------------------------------- the context itself


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64,
                                   torch.float8_e4m3fn, torch.int16], ids=str)
@pytest.mark.parametrize("block_log2", [8, 12, 15])
def test_torch_context_matches_the_reference(dtype, block_log2):
    g = torch.Generator().manual_seed(block_log2)
    old = random_bits((70_001,), dtype, g)
    nib, e_tops = _context.class_nibbles(old, fmt.dtype_of(dtype), block_log2)
    dt = fmt.dtype_of(dtype)
    bits = old.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[old.element_size()]).numpy()
    bits = bits.view({8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint64}[dt.bits])
    want_cls, want_top = [], []
    for lo in range(0, bits.size, 1 << block_log2):
        e, c = ref_ctx.block_context(bits[lo : lo + (1 << block_log2)], dt)
        want_top.append(e)
        want_cls.append(c)
    assert e_tops.tolist() == want_top
    assert np.array_equal(nib.numpy(), ref_ctx.pack_nibbles(np.concatenate(want_cls)))


def test_e_top_ignores_inf_nan_and_unsampled_elements():
    dt = fmt.DTYPES["bfloat16"]
    x = np.full(40_000, 0x3C00, np.uint16)  # exponent 120
    x[5] = 0x7F80  # +inf: exponent 255, not counted
    x[2000] = 0x4000  # exponent 128, outside the sample (2000 % 16384 >= 1024)
    x[16384 + 3] = 0x3E00  # exponent 124, sampled
    assert ref_ctx.choose_e_top(x, dt) == 124
    classes = ref_ctx.classes_of(x, dt, 124)
    assert classes[0] == 4 and classes[5] == 0 and classes[2000] == 0 and classes[16387] == 0


def test_probability_rules_are_integer_and_clamped():
    assert ref_ctx.position_probabilities([0, 5, 1000], [10, 10, 1], 21) == [0, 32768, 65535]  # sample = block
    assert ref_ctx.position_probabilities([5], [10], 100) == [3277]  # a tenth of the block sampled: 5 in 100
    assert ref_ctx.continue_probability(0, 7) == 1 and ref_ctx.continue_probability(7, 7) == 65535
    assert ref_ctx.continue_probability(1, 2) == 32768


# ---------------------------------------------------------------------------------- SIMD levels

_SIMD_PROBE = r"""
import hashlib, sys, torch
from syncd.ops import _backend, delta
from tests.ops._util import perturb, random_bits
sys.path.insert(0, ".")
from tests.ops.test_delta_v2 import block_modes as blob_modes, mode_1_blob, weight_pair
out = [_backend.native().CODEC_SIMD]
cases = [weight_pair(n, s, seed=n) for n, s in ((70_001, 1e-7), (300_000, 1e-6), (1 << 18, 3e-5), (99_999, 1e-3),
                                                 (200_003, 3e-7), (1 << 17, 1e-6))]
g = torch.Generator().manual_seed(5)
for dt in (torch.bfloat16, torch.float16, torch.int16, torch.float32, torch.uint8):
    old = random_bits((50_000,), dt, g)
    cases.append((old, perturb(old, 0.2, g, max_step=300)))
for old, new in cases[2:4]:  # blobs written before mode 2 (J in position order) still decode
    t = old.clone()
    delta.apply_(t, mode_1_blob(old, new))
    out.append(f"mode 1 {torch.equal(t.view(torch.uint8), new.view(torch.uint8))}")
for old, new in cases:
    blob = delta.encode(old, new, version=2, block_log2=16)
    t = old.clone()
    delta.apply_(t, blob)
    ok = torch.equal(t.view(torch.uint8), new.view(torch.uint8))
    back = old.clone()
    bad = bytearray(blob)
    bad[-2] ^= 0x20
    try:
        delta.apply_(back, bytes(bad))
    except Exception as e:
        kept = torch.equal(back.view(torch.uint8), old.view(torch.uint8))
    out.append(f"{hashlib.sha256(blob).hexdigest()[:16]} {sorted(set(blob_modes(blob)))} {ok} {kept}")
print("\n".join(out))
"""


def test_every_simd_level_writes_and_reads_the_same_bytes():
    """The scalar, AVX2 and AVX-512 kernels (SYNCD_SIMD caps the level; the CPU may offer fewer) write the
    same blobs and decode them to the same tensors, and undo a failed apply the same way."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    runs = {}
    for level in ("scalar", "avx2", "avx512"):
        env = dict(os.environ, SYNCD_SIMD=level)
        proc = subprocess.run([sys.executable, "-c", _SIMD_PROBE], cwd=root, env=env, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        got, *lines = proc.stdout.split("\n")
        runs[got] = [ln for ln in lines if ln]
    assert "scalar" in runs
    first = runs["scalar"]
    assert all(line.endswith("True True") or line == "mode 1 True" for line in first), first
    assert sum(line.startswith("mode 1") for line in first) == 2, first
    assert sum("3]" in line for line in first) >= 2 and sum("2]" in line for line in first) >= 2, first  # modes 3, 2
    for level, lines in runs.items():
        assert lines == first, level


@pytest.mark.parametrize("block_log2", [12, 16])
def test_decoding_with_classes_from_a_gpu_matches_decoding_with_the_base(block_log2):
    """A GPU base is not copied to the host: its classes are computed on the device for the blob's e_tops
    (``_context.class_nibbles``) and the host decodes with them. Same positions and values as with the base."""
    from syncd.ops import _backend, _blob

    old, new = weight_pair(300_001, 1e-5)
    blob = delta.encode(old, new, version=2, block_log2=block_log2)
    assert delta.inspect(blob)["context_blocks"] >= 1
    dt = fmt.dtype_of(old.dtype)
    e_tops = torch.tensor([max(0, e) for e in _blob.block_e_tops(blob)], dtype=torch.int64)
    nib = _context.class_nibbles(old, dt, block_log2, e_tops)[0].numpy()
    native = _backend.native()
    with_base = native.unpack(blob, dt.code, [old.numel()], 2, old.data_ptr(), None)
    with_nibbles = native.unpack(blob, dt.code, [old.numel()], 2, 0, nib)
    assert np.array_equal(with_base[0], with_nibbles[0]) and np.array_equal(with_base[1], with_nibbles[1])
    assert _blob.block_e_tops(blob) == native.block_e_tops(blob)
    # and the GPU encoder's route: changes and classes found elsewhere, entropy-coded by the host
    nib_enc, e_tops_enc = _context.class_nibbles(old, dt, block_log2)
    h = fmt.parse_header(blob, ref_ck.checksum_bytes)
    packed = native.pack(dt.code, [old.numel()], block_log2, with_base[0], with_base[1], h.base_checksum,
                         h.new_checksum, 1, 2, nib_enc.numpy(), e_tops_enc.tolist())
    assert bytes(packed) == blob


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_a_wrong_base_is_named_although_its_classes_break_the_decode(backend):
    """With another base, a context block's classes are wrong and its streams fail to decode; apply_ still
    reports the wrong base (the checksum the engines match on) and leaves the target as it was."""
    old, new = weight_pair(1 << 21, 1e-5)
    blob = delta.encode(old, new, version=2)
    assert delta.inspect(blob)["context_blocks"] >= 2
    for base in (new, old * 1.5):
        t = base.clone()
        with pytest.raises(DeltaError, match="wrong base"):
            delta.apply_(t, blob, backend=backend)
        assert same_bits(t, base)
    with pytest.raises(DeltaError, match="binary stream|positions"):  # changes() has no checksum to go by
        delta.changes(blob, base=old * 1.5)


def test_decoded_change_buffers_are_reused_and_start_clean():
    """Format-2 applies keep their decoded-change buffers for later calls (fresh pages cost a fault per 4 KiB):
    a later apply, sparser or denser, sees none of an earlier one's changes, undo after reuse still restores
    the target, and repeating a call does not grow the pool past what one call needs."""
    from syncd.ops import _backend
    from tests.ops._util import reseal

    native = _backend.native()
    pairs = [weight_pair(1 << 18, step, seed=i) for i, step in enumerate((3e-4, 1e-6, 3e-5))]
    blobs = [delta.encode(o, n, block_log2=14, version=2) for o, n in pairs]
    assert all(delta.inspect(b)["context_blocks"] > 0 for b in blobs)
    held, before = [], native.changes_pool_bytes()  # the pool is the process's: earlier tests filled it
    for _ in range(2):
        for (old, new), blob in zip(pairs, blobs):
            t = old.clone()
            delta.apply_many([t], [blob])
            assert same_bits(t, new)
            held.append(native.changes_pool_bytes())
    # it grows by at most one buffer per block of a call, each at most 1.5x (its growth step) the largest
    # block's need: a bitmap of 2 bytes per 16 words and 3 bytes per change (+64)
    most = max(n for b in blobs for _, n, _ in fmt.parse_header(b, ref_ck.checksum_bytes).blocks)
    blocks = (1 << 18) >> 14
    assert max(held) - before <= 1.5 * blocks * (2 * (1024 + 2) + 3 * (most + 64))
    assert 0 < max(held) <= native.changes_pool_keep_bytes
    (old, new), bad = pairs[0], bytearray(blobs[0])
    bad[-20] ^= 0x55
    t = old.clone()
    with pytest.raises(DeltaError):
        delta.apply_many([t], [reseal(bytes(bad))])
    assert same_bits(t, old)
