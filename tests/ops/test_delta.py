"""Round trips and cross-backend agreement of the delta codec (syncd.ops.delta)."""

from __future__ import annotations

import pytest
import torch

from syncd.errors import BackendUnavailable, DeltaError
from syncd.ops import _format as fmt
from syncd.ops import checksum, delta
from tests.ops._util import ALL_DTYPES, on, perturb, random_bits, same_bits

CPU_BACKENDS = ["cpu", "reference", "triton"]  # triton runs interpreted on CPU tensors in CI
SHAPES = [(), (0,), (1,), (7,), (3, 5, 1), (1000, 3), (4099,)]


def _pair(shape, dtype, density, seed):
    g = torch.Generator().manual_seed(seed)
    old = random_bits(shape, dtype, g)
    return old, perturb(old, density, g)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_round_trip_every_dtype_and_shape(dtype, shape):
    old, new = _pair(shape, dtype, 0.2, seed=hash((str(dtype), shape)) % 1000)
    blob = delta.encode(old, new, backend="cpu", block_log2=8)
    out = delta.decode(old, blob, backend="cpu")
    assert same_bits(out, new)
    info = delta.inspect(blob)
    assert info["dtype"] == str(dtype).removeprefix("torch.")
    assert info["shape"] == tuple(shape)
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[old.element_size()]
    assert info["changed"] == int((old.reshape(-1).view(view) != new.reshape(-1).view(view)).sum())
    assert info["base_checksum"] == checksum(old) and info["new_checksum"] == checksum(new)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_backends_write_identical_blobs_and_read_each_other(dtype):
    old, new = _pair((37, 41), dtype, 0.1, seed=7)
    blobs = {b: delta.encode(on(old, b), on(new, b), backend=b, block_log2=8) for b in CPU_BACKENDS}
    assert blobs["cpu"] == blobs["reference"] == blobs["triton"]
    for b in CPU_BACKENDS:
        t = on(old.clone(), b)
        delta.apply_(t, blobs["cpu"], backend=b)
        assert same_bits(t, new), b


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_every_bit_pattern_round_trips(dtype):
    """Every value of the type, including -0.0, each NaN payload, +-inf and subnormals, as old and as new."""
    bits = 8 * torch.empty((), dtype=dtype).element_size()
    allv = torch.arange(2**bits, dtype=torch.int32).to(torch.int16 if bits == 16 else torch.uint8)
    if bits == 8:
        allv = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    old = allv.view(dtype)
    g = torch.Generator().manual_seed(1)
    new = old[torch.randperm(old.numel(), generator=g)]
    for be in CPU_BACKENDS if bits == 8 else ["cpu", "reference"]:
        blob = delta.encode(on(old, be), on(new, be), backend=be)
        assert same_bits(delta.decode(old, blob, backend="cpu"), new)
        assert same_bits(delta.decode(new, delta.encode(on(new, be), on(old, be), backend=be), backend="reference"), old)


def test_float_keys_make_one_ulp_a_small_integer():
    """+-1 ulp steps (and -0.0 <-> +0.0) cost about a bit each: far below a raw 16-bit word."""
    g = torch.Generator().manual_seed(3)
    old = torch.randn(1 << 16, generator=g).to(torch.bfloat16)
    up = (old.view(torch.int16) + torch.where(old >= 0, 1, -1).to(torch.int16)).view(torch.bfloat16)
    blob = delta.encode(old, up, backend="cpu")
    assert len(blob) < old.numel() * 0.25  # 2 bytes/elem raw; ~1 bit value + ~0 bit position each
    zeros = torch.tensor([0.0, -0.0] * 64, dtype=torch.bfloat16)
    flipped = torch.tensor([-0.0, 0.0] * 64, dtype=torch.bfloat16)
    assert same_bits(delta.decode(zeros, delta.encode(zeros, flipped)), flipped)


def test_unchanged_tensor_is_tiny_and_identity():
    x = torch.randn(100_000).to(torch.bfloat16)
    blob = delta.encode(x, x.clone())
    assert delta.inspect(blob)["changed"] == 0
    assert len(blob) == fmt.header_size(1, 1)
    assert same_bits(delta.decode(x, blob), x)


def test_apply_non_contiguous_target_and_inputs():
    g = torch.Generator().manual_seed(5)
    base = torch.randn(64, 48, generator=g).to(torch.bfloat16)
    old = base.t()  # non-contiguous
    new = perturb(old.contiguous(), 0.1, g).reshape(48, 64)
    blob = delta.encode(old, new)
    for be in CPU_BACKENDS:
        target = on(base.clone(), be).t()
        delta.apply_(target, blob, backend=be)
        assert not target.is_contiguous()
        assert same_bits(target.contiguous(), new)


def test_large_multi_block_parallel_round_trip():
    g = torch.Generator().manual_seed(11)
    old = torch.randn(3_000_001, generator=g).to(torch.bfloat16)
    new = perturb(old, 0.01, g)
    blob = delta.encode(old, new, block_log2=16)
    assert delta.inspect(blob)["blocks"] == (old.numel() + 65535) // 65536
    t = old.clone()
    delta.apply_(t, blob)
    assert same_bits(t, new)
    assert delta.encode(old, new, block_log2=16, backend="cpu") == blob


def test_mismatched_inputs_raise():
    a = torch.zeros(4, dtype=torch.bfloat16)
    with pytest.raises(DeltaError, match="dtype"):
        delta.encode(a, torch.zeros(4, dtype=torch.float16))
    with pytest.raises(DeltaError, match="shape"):
        delta.encode(a, torch.zeros(5, dtype=torch.bfloat16))
    with pytest.raises(DeltaError, match="not supported"):
        delta.encode(torch.zeros(2, dtype=torch.complex64), torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(DeltaError, match="block_log2"):
        delta.encode(a, a, block_log2=30)


def test_unknown_or_unavailable_backend_says_why():
    a = torch.zeros(4)
    with pytest.raises(BackendUnavailable, match="unknown backend"):
        delta.encode(a, a, backend="fpga")
    if not torch.cuda.is_available():
        with pytest.raises(BackendUnavailable, match="CUDA"):
            delta.encode(a, a, backend="cuda")


def test_native_constants_match_the_python_spec():
    from syncd.ops import _backend

    n = _backend.native()
    assert (n.FORMAT_VERSIONS, n.DEFAULT_FORMAT, n.PROB_BITS, n.RANS_L, n.DEFAULT_BLOCK_LOG2) == (
        fmt.FORMAT_VERSIONS, fmt.DEFAULT_FORMAT, fmt.PROB_BITS, fmt.RANS_L, fmt.DEFAULT_BLOCK_LOG2)


def test_inspect_reports_sections():
    old, new = _pair((5000,), torch.bfloat16, 0.05, seed=2)
    info = delta.inspect(delta.encode(old, new, block_log2=10))
    assert info["format_version"] == 1 and info["blocks"] == 5
    assert info["header_bytes"] + info["payload_bytes"] == info["total_bytes"]
    s = info["sections"]
    assert s["tables"] + s["raw_bits"] + s["rans"] + s["lengths"] == info["payload_bytes"]
    assert s["rans"] > 0


def test_many_matches_one_by_one_and_isolates_failures():
    g = torch.Generator().manual_seed(21)
    olds = [torch.randn(n, generator=g).to(torch.bfloat16) for n in (5, 3000, 70_000, 1_200_000)]
    news = [perturb(o, 0.05, g) for o in olds]
    blobs = delta.encode_many(olds, news, block_log2=16)
    assert blobs == [delta.encode(o, n, block_log2=16) for o, n in zip(olds, news)]
    work = [o.clone() for o in olds]
    delta.apply_many(work, blobs)
    assert all(same_bits(w, n) for w, n in zip(work, news))
    work = [o.clone() for o in olds]
    bad = list(blobs)
    bad[1] = bad[1][:-3]
    with pytest.raises(DeltaError, match="truncated"):
        delta.apply_many(work, bad)
    assert same_bits(work[1], olds[1])
    assert all(same_bits(work[i], news[i]) for i in (0, 2, 3))
