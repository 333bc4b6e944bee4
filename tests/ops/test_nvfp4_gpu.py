"""NVFP4 on the GPU backends (CUDA C++ and compiled Triton) against the native CPU backend and the reference,
bit for bit. Skipped without a GPU; run by bench/gpu_check.sh on the GPU machine."""

from __future__ import annotations

import pytest
import torch

from syncd.ops import _backend, nvfp4
from tests.ops.test_nvfp4_helpers import KINDS, sample
from tests.ops._util import same_bits

pytestmark = pytest.mark.gpu
GPU_BACKENDS = ["cuda", "triton"]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def assert_same_q(got, want):
    assert same_bits(got.qdata.cpu(), want.qdata.cpu())
    assert same_bits(got.scales.cpu(), want.scales.cpu())
    assert same_bits(got.per_tensor_scale.cpu(), want.per_tensor_scale.cpu())


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_quantize_matches_cpu(backend, dtype):
    g = torch.Generator().manual_seed(DTYPES.index(dtype))
    for kind in KINDS:
        for shape in [(16,), (5, 48), (3, 129, 64), (1000, 4096)]:
            x = sample(kind, shape, g, dtype)
            if not torch.isfinite(x).all():
                continue
            want = nvfp4.quantize(x, backend="cpu")
            assert_same_q(nvfp4.quantize(x.cuda(), backend=backend), want)
            pts = want.per_tensor_scale * 0.5
            if pts.item() >= 2.0 ** -100:
                assert_same_q(nvfp4.quantize(x.cuda(), per_tensor_scale=pts, backend=backend),
                              nvfp4.quantize(x, per_tensor_scale=pts, backend="cpu"))


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_large_and_unaligned_inputs(backend):
    g = torch.Generator().manual_seed(1)
    x = sample("outlier_rows", (4096, 4096), g)
    want = nvfp4.quantize(x, backend="cpu", swizzle=True)
    assert_same_q(nvfp4.quantize(x.cuda(), backend=backend, swizzle=True), want)
    flat = x.reshape(-1)[8:8 + 16 * 1000]  # a view starting 16 bytes in: realigned or handled
    odd = x.reshape(-1)[1:1 + 16 * 1000]
    for v in (flat, odd):
        assert_same_q(nvfp4.quantize(v.cuda(), backend=backend), nvfp4.quantize(v, backend="cpu"))


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_dequantize_every_code_and_scale(backend):
    qdata = torch.arange(256, dtype=torch.uint8).repeat(127, 1).reshape(127 * 32, 8)
    scales = torch.arange(127, dtype=torch.uint8).repeat_interleave(32).reshape(127 * 32, 1)
    for pts in (2.0 ** -100, 1.1e-3, 1.0, 2.0 ** 100):
        q = nvfp4.NVFP4Tensor(qdata, scales.view(torch.float8_e4m3fn), torch.tensor(pts))
        for dtype in DTYPES:
            assert same_bits(nvfp4.dequantize(q.to("cuda"), dtype, backend=backend),
                             nvfp4.dequantize(q, dtype, backend="reference"))


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_edge_cases(backend):
    z = torch.zeros(8, 64, dtype=torch.bfloat16)
    z[0, 1] = -0.0
    assert_same_q(nvfp4.quantize(z.cuda(), backend=backend), nvfp4.quantize(z, backend="reference"))
    for bad in (float("nan"), float("inf")):
        x = torch.randn(4, 64, device="cuda")
        x[2, 5] = bad
        with pytest.raises(ValueError, match="NaN or infinite"):
            nvfp4.quantize(x, backend=backend)
        with pytest.raises(ValueError, match="NaN or infinite"):
            nvfp4.quantize(x, per_tensor_scale=0.01, backend=backend)


def test_auto_picks_a_gpu_backend_for_cuda_tensors():
    assert _backend.resolve("auto", "cuda", "nvfp4_quantize") in GPU_BACKENDS
    assert _backend.resolve("auto", "cuda", "nvfp4_dequantize") in GPU_BACKENDS


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_dequantize_into_an_unaligned_view(backend):
    q = nvfp4.quantize(sample("normal", (4, 64), torch.Generator().manual_seed(3)))
    buf = torch.zeros(4 * 64 + 3, dtype=torch.bfloat16, device="cuda")
    view = buf[3:].view(4, 64)
    nvfp4.dequantize(q.to("cuda"), torch.bfloat16, out=view, backend=backend)
    assert same_bits(view.cpu(), nvfp4.dequantize(q, torch.bfloat16, backend="cpu"))
