"""GPU backends (CUDA C++ and compiled Triton) against the reference, bit for bit. Skipped without a GPU;
run by bench/gpu_check.sh on the GPU machine."""

from __future__ import annotations

import struct

import pytest
import torch

from syncd.errors import DeltaError
from syncd.ops import _format as fmt
from syncd.ops import checksum, delta
from syncd.ops.reference import checksum as ck
from tests.ops._util import ALL_DTYPES, perturb, random_bits, same_bits

pytestmark = pytest.mark.gpu
GPU_BACKENDS = ["cuda", "triton"]


@pytest.mark.parametrize("version", fmt.FORMAT_VERSIONS)
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_gpu_encode_apply_match_reference(backend, dtype, version):
    """Format 2's context blocks: the GPU computes the old elements' classes, the host entropy-codes (encode)
    or decodes (apply) with them; the bytes and results are the CPU codec's."""
    g = torch.Generator().manual_seed(3)
    old = random_bits((1_000_003,), dtype, g)
    new = perturb(old, 0.02, g, max_step=5)
    want = delta.encode(old, new, backend="cpu", version=version, block_log2=18)
    if version == 2 and dtype.is_floating_point and dtype.itemsize > 1:
        assert delta.inspect(want)["context_blocks"] >= 1
    got = delta.encode(old.cuda(), new.cuda(), backend=backend, version=version, block_log2=18)
    assert got == want
    t = old.cuda()
    delta.apply_(t, want, backend=backend)
    assert same_bits(t, new)
    assert checksum(new.cuda(), backend=backend) == checksum(new, backend="reference")
    c = delta.changes(want, base=old.cuda())  # what an engine stages: classes from its GPU copy
    ref_c = delta.changes(want, base=old)
    assert torch.equal(c.positions, ref_c.positions) and torch.equal(c.values, ref_c.values)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn], ids=str)
def test_gpu_class_nibbles_match_the_host(dtype):
    from syncd.ops import _context

    old = random_bits((300_001,), dtype, torch.Generator().manual_seed(5))
    dt = fmt.dtype_of(dtype)
    nib_h, e_h = _context.class_nibbles(old, dt, 16)
    nib_d, e_d = _context.class_nibbles(old.cuda(), dt, 16)
    assert torch.equal(nib_h, nib_d.cpu()) and torch.equal(e_h, e_d.cpu())


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_wrong_base_of_a_format_2_blob(backend):
    g = torch.Generator().manual_seed(6)
    old = (torch.randn(1 << 20, generator=g) * 0.02).to(torch.bfloat16)
    new = perturb(old, 0.05, g)
    blob = delta.encode(old, new, version=2)
    assert delta.inspect(blob)["context_blocks"] >= 1
    t = (old * 1.5).cuda()
    with pytest.raises(DeltaError, match="wrong base"):
        delta.apply_(t, blob, backend=backend)
    assert same_bits(t, old * 1.5)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 4097, 3_000_017])
def test_gpu_checksum_every_length(backend, n):
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    assert checksum(data.cuda(), backend=backend) == checksum(data, backend="reference")


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_checksum_of_unaligned_view(backend):
    data = torch.randint(0, 256, (10_001,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    assert checksum(data.cuda()[3:], backend=backend) == checksum(data[3:], backend="reference")


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_wrong_base_and_bad_result_leave_target_unchanged(backend):
    g = torch.Generator().manual_seed(4)
    old = torch.randn(100_000, generator=g).to(torch.bfloat16)
    new = perturb(old, 0.05, g)
    blob = delta.encode(old, new)
    t = new.cuda()
    with pytest.raises(DeltaError, match="wrong base"):
        delta.apply_(t, blob, backend=backend)
    assert same_bits(t, new)
    # a blob whose recorded result checksum is wrong: scatter runs, the check fails, the scatter is undone
    b = bytearray(blob)
    struct.pack_into("<Q", b, 40, 12345)
    hsize = fmt.header_size(1, 1)
    struct.pack_into("<Q", b, hsize - 8, ck.checksum_bytes(bytes(b[: hsize - 8])))
    t = old.cuda()
    with pytest.raises(DeltaError, match="result checksum"):
        delta.apply_(t, bytes(b), backend=backend)
    assert same_bits(t, old)


def test_auto_picks_a_gpu_backend_for_cuda_tensors():
    from syncd.ops import _backend

    assert _backend.resolve("auto", "cuda") in GPU_BACKENDS
