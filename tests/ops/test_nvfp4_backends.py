"""Every NVFP4 backend against the reference, bit for bit: quantize on many shapes, dtypes and distributions,
dequantize on every (code byte, scale) pair, the edge cases, and argument validation. Triton runs
interpreted on the CPU at small sizes (a GPU run of the same checks is in test_nvfp4_gpu.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from syncd.errors import BackendUnavailable
from syncd.ops import _backend, nvfp4
from syncd.ops.reference import nvfp4 as ref
from tests.ops.test_nvfp4_helpers import KINDS, e2m1_brute, sample
from tests.ops._util import on, same_bits

BACKENDS = ["cpu", "triton"]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def assert_same_q(got: nvfp4.NVFP4Tensor, want: nvfp4.NVFP4Tensor) -> None:
    assert got.swizzled == want.swizzled
    assert same_bits(got.qdata.cpu(), want.qdata.cpu())
    assert same_bits(got.scales.cpu(), want.scales.cpu())
    assert same_bits(got.per_tensor_scale.cpu(), want.per_tensor_scale.cpu())


def _small(shape) -> bool:
    return int(np.prod(shape)) <= 4096


SHAPES = [(16,), (3, 32), (17, 48), (2, 5, 64), (129, 80)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_quantize_matches_reference(backend, dtype, kind):
    g = torch.Generator().manual_seed(7 * KINDS.index(kind) + DTYPES.index(dtype))
    shapes = SHAPES if backend == "cpu" else [s for s in SHAPES if _small(s)]
    for shape in shapes:
        x = sample(kind, shape, g, dtype)
        if not torch.isfinite(x).all():  # "huge" in float16/bfloat16 overflows: not an ordinary input
            continue
        want = nvfp4.quantize(x, backend="reference")
        assert_same_q(nvfp4.quantize(on(x, backend), backend=backend), want)
        # a given (calibrated) per-tensor scale, smaller than amax/2688: saturating block scales and codes
        pts = want.per_tensor_scale * 0.37
        if pts.item() >= ref.PTS_MIN:
            assert_same_q(nvfp4.quantize(on(x, backend), per_tensor_scale=pts, backend=backend),
                          nvfp4.quantize(x, per_tensor_scale=pts, backend="reference"))


def test_native_simd_and_portable_paths_agree_on_many_blocks():
    native = _backend.native()
    g = torch.Generator().manual_seed(11)
    n = (1 << 14) * 2 * 16 + 48  # three work items, on two threads
    for dtype, code in [(torch.bfloat16, 1), (torch.float16, 2), (torch.float32, 3)]:
        x = sample("lognormal", (n,), g, dtype)
        x[5] = -0.0
        pts = float(nvfp4.per_tensor_scale(x, backend="reference"))
        outs = []
        for simd in (True, False):
            q = torch.empty(n // 2, dtype=torch.uint8)
            s = torch.empty(n // 16, dtype=torch.uint8)
            amax, bad = native.nvfp4_amax(x.data_ptr(), n, code, 2, simd)
            assert not bad and amax == x.float().abs().max().item()
            assert not native.nvfp4_quantize(x.data_ptr(), n // 16, code, pts, q.data_ptr(), s.data_ptr(), 2, simd)
            deq = {}
            for out_dtype, out_code in [(torch.bfloat16, 1), (torch.float16, 2), (torch.float32, 3)]:
                o = torch.empty(n, dtype=out_dtype)
                native.nvfp4_dequantize(q.data_ptr(), s.data_ptr(), n // 16, pts, o.data_ptr(), out_code, 2, simd)
                deq[out_dtype] = o
            outs.append((q, s, deq))
        want = nvfp4.quantize(x, backend="reference")
        for q, s, deq in outs:
            assert torch.equal(q, want.qdata) and torch.equal(s, want.scales.view(torch.uint8))
            for out_dtype, o in deq.items():
                assert same_bits(o, nvfp4.dequantize(want, out_dtype, backend="reference"))


def _every_code_and_scale(pts: float) -> nvfp4.NVFP4Tensor:
    """All 256 code bytes (two codes each) against all 127 non-negative finite scales."""
    qdata = torch.arange(256, dtype=torch.uint8).repeat(127, 1).reshape(127 * 32, 8)
    scales = torch.arange(127, dtype=torch.uint8).repeat_interleave(32).reshape(127 * 32, 1)
    return nvfp4.NVFP4Tensor(qdata, scales.view(torch.float8_e4m3fn), torch.tensor(pts, dtype=torch.float32))


@pytest.mark.parametrize("backend,pts", [("cpu", p) for p in (2.0 ** -100, 1.1e-3, 1.0, 3.7e4, 2.0 ** 100)]
                         + [("triton", p) for p in (2.0 ** -100, 1.1e-3, 2.0 ** 100)])
def test_dequantize_every_code_and_scale_matches_reference(backend, pts):
    q = _every_code_and_scale(pts)
    for dtype in DTYPES:
        want = nvfp4.dequantize(q, dtype, backend="reference")
        got = nvfp4.dequantize(q.to(on(q.qdata, backend).device), dtype, backend=backend)
        assert got.dtype == dtype and got.shape == (127 * 32, 16)
        assert same_bits(got, want), dtype


def test_dequantize_values_are_code_times_scale():
    q = _every_code_and_scale(1.0)
    got = nvfp4.dequantize(q, torch.float32, backend="cpu").double()
    codes = ref.unpack_codes(q.qdata).long()
    want = torch.tensor(ref.E2M1_VALUES, dtype=torch.float64)[codes] * q.scales.double()  # exact in float32
    assert torch.equal(got, want)


@pytest.mark.parametrize("backend", ["reference"] + BACKENDS)
def test_e2m1_rounding_on_every_backend(backend):
    # blocks holding 6.0 with pts = 2**-8 get block scale 256 and output scale exactly 1: codes = e2m1(x)
    rng = np.random.default_rng(5)
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=np.float32)
    vals = np.concatenate([mids, np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(9)),
                           rng.uniform(0, 6, 200).astype(np.float32), [0.0, 6.0, 5.999]]).astype(np.float32)
    vals = np.concatenate([vals, -vals, [np.float32(-0.0)]])
    vals = np.resize(vals, (len(vals) + 14) // 15 * 15).reshape(-1, 15)
    x = torch.from_numpy(np.concatenate([np.full((len(vals), 1), 6.0, np.float32), vals], axis=1))
    q = nvfp4.quantize(on(x, backend), per_tensor_scale=2.0 ** -8, backend=backend)
    assert (q.scales.float().cpu() == 256).all()
    codes = ref.unpack_codes(q.qdata.cpu()).numpy().reshape(-1)
    np.testing.assert_array_equal(codes, e2m1_brute(x.numpy().reshape(-1)))


@pytest.mark.parametrize("backend", ["reference"] + BACKENDS)
def test_all_zero_input_gives_zeros_and_finite_scales(backend):
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    x[1, 3] = -0.0
    q = nvfp4.quantize(on(x, backend), backend=backend)
    assert q.per_tensor_scale.item() == 2.0 ** -100
    assert (q.scales.float() == 0).all()
    codes = ref.unpack_codes(q.qdata.cpu())
    assert codes[1, 3] == 8 and int((codes != 0).sum()) == 1  # -0.0 keeps its sign
    out = nvfp4.dequantize(q, torch.bfloat16, backend=backend).cpu()
    assert same_bits(out, x)


@pytest.mark.parametrize("backend", ["reference"] + BACKENDS)
def test_underflowing_block_scales_give_zero_scale_and_signed_zero_codes(backend):
    x = torch.zeros(3, 16)
    x[0] = 1000.0  # the tensor amax: pts = 1000/2688
    x[1, :4] = torch.tensor([1e-4, -1e-4, 2e-5, -0.0])  # scale 448 * 1e-4/1000 = 4.5e-5 < 2**-10: underflows to 0
    x[2, :2] = torch.tensor([0.02, -0.01])  # scale 448 * 0.02/1000 = 0.009: an E4M3 subnormal (< 2**-6)
    q = nvfp4.quantize(on(x, backend), backend=backend)
    sc = q.scales.cpu().view(torch.uint8)[:, 0].tolist()
    assert sc[0] == 126 and sc[1] == 0 and 0 < sc[2] < 8
    codes = ref.unpack_codes(q.qdata.cpu())
    assert codes[1, :4].tolist() == [0, 8, 0, 8]
    assert codes[2, :2].tolist() == [7, 13]  # a subnormal scale is coarse: 0.02 -> 5.5 -> 6, -0.01 -> -2.75 -> -3
    assert same_bits(q.qdata.cpu(), nvfp4.quantize(x, backend="reference").qdata)


@pytest.mark.parametrize("backend", ["reference"] + BACKENDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_and_inf_raise(backend, bad):
    for dtype in DTYPES:
        for n, at in [(64, 17), (4096, 3000), (4128, 4127)]:  # the SIMD body and the tail of the amax pass
            x = torch.randn(n // 32, 32).to(dtype)
            x.view(-1)[at] = bad
            with pytest.raises(ValueError, match="NaN or infinite"):
                nvfp4.quantize(on(x, backend), backend=backend)
            with pytest.raises(ValueError, match="NaN or infinite"):
                nvfp4.quantize(on(x, backend), per_tensor_scale=0.01, backend=backend)
            if backend == "triton":
                break


@pytest.mark.parametrize("backend", ["reference"] + BACKENDS)
def test_layouts_and_odd_inputs(backend):
    g = torch.Generator().manual_seed(9)
    x = sample("normal", (3, 130, 32), g)
    q = nvfp4.quantize(on(x, backend), backend=backend)
    assert q.qdata.shape == (3, 130, 16) and q.scales.shape == (3, 130, 2) and q.per_tensor_scale.shape == ()
    sw = nvfp4.quantize(on(x, backend), swizzle=True, backend=backend)
    assert sw.swizzled and sw.scales.shape == (3, 256, 4)
    assert_same_q(sw.to_linear(), q)
    assert_same_q(q.to_swizzled(), sw)
    assert same_bits(sw.dequantize(torch.float32, backend=backend), q.dequantize(torch.float32, backend=backend))
    # a non-contiguous input quantizes as its contiguous copy; an empty one gives empty parts
    t = sample("normal", (64, 48), g).t()
    assert_same_q(nvfp4.quantize(on(t, backend), backend=backend), nvfp4.quantize(t.contiguous(), backend="reference"))
    e = nvfp4.quantize(on(torch.zeros(0, 32), backend), backend=backend)
    assert e.qdata.shape == (0, 16) and e.scales.shape == (0, 2)
    assert nvfp4.dequantize(e, backend=backend).shape == (0, 32)
    one = nvfp4.quantize(on(x[0, 0], backend), swizzle=True, backend=backend)  # 1-d: one row
    assert one.scales.shape == (128, 4) and one.shape == (32,)
    assert same_bits(one.dequantize(backend=backend).cpu(), nvfp4.quantize(x[0, 0], backend="reference").dequantize())


def test_float16_input_quantizes_like_its_float32_value():
    g = torch.Generator().manual_seed(4)
    x = sample("laplace", (40, 64), g, torch.float16)
    assert_same_q(nvfp4.quantize(x, backend="cpu"), nvfp4.quantize(x.float(), backend="cpu"))


def test_invalid_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4.quantize(torch.zeros(4, 24))
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4.quantize(torch.tensor(1.0))
    with pytest.raises(ValueError, match="bfloat16, float16 or float32"):
        nvfp4.quantize(torch.zeros(4, 16, dtype=torch.int32))
    with pytest.raises(TypeError):
        nvfp4.quantize([0.0] * 16)
    for bad in (0.0, -1.0, float("nan"), float("inf"), 2.0 ** -120, 2.0 ** 101):
        with pytest.raises(ValueError, match="per_tensor_scale"):
            nvfp4.quantize(torch.zeros(1, 16), per_tensor_scale=bad)
    with pytest.raises(ValueError, match="one value"):
        nvfp4.quantize(torch.zeros(1, 16), per_tensor_scale=torch.ones(2))
    q = nvfp4.quantize(torch.zeros(2, 32))
    with pytest.raises(ValueError, match="bfloat16, float16 or float32"):
        nvfp4.dequantize(q, torch.int8)
    with pytest.raises(TypeError):
        nvfp4.dequantize(q.qdata)
    with pytest.raises(ValueError, match="do not fit"):
        nvfp4.NVFP4Tensor(q.qdata, q.scales[:, :1], q.per_tensor_scale)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        nvfp4.NVFP4Tensor(q.qdata, q.scales.view(torch.uint8), q.per_tensor_scale)
    with pytest.raises(ValueError, match="float32"):
        nvfp4.NVFP4Tensor(q.qdata, q.scales, q.per_tensor_scale.to(torch.bfloat16))
    with pytest.raises(ValueError, match="do not fit"):
        nvfp4.unswizzle_scales(q.scales, (2, 32))
    with pytest.raises(BackendUnavailable, match="cuda"):
        nvfp4.quantize(torch.zeros(1, 16), backend="cuda")
    with pytest.raises(BackendUnavailable):
        nvfp4.quantize(torch.zeros(1, 16), backend="fast")


@pytest.mark.parametrize("backend", ["reference"] + BACKENDS)
def test_dequantize_into_out(backend):
    q = nvfp4.quantize(sample("laplace", (8, 64), torch.Generator().manual_seed(2)))
    q = q.to(on(q.qdata, backend).device)
    for dtype in DTYPES:
        out = torch.full(q.shape, 7.0, dtype=dtype, device=q.device)
        assert nvfp4.dequantize(q, dtype, out=out, backend=backend) is out
        assert same_bits(out.cpu(), nvfp4.dequantize(q.to("cpu"), dtype, backend="reference"))
    with pytest.raises(ValueError, match="out must be"):
        nvfp4.dequantize(q, torch.bfloat16, out=torch.empty(8, 64, dtype=torch.float32), backend=backend)
    with pytest.raises(ValueError, match="out must be"):
        nvfp4.dequantize(q, torch.float32, out=torch.empty(64, 8).t(), backend=backend)


def test_flush_to_zero_does_not_change_results():
    """The per-tensor scale range [2**-100, 2**100] keeps every intermediate a normal float32, so denormal
    flushing (torch.set_flush_denormal, a GPU's ftz) cannot change a code, a scale or a dequantized value."""
    g = torch.Generator().manual_seed(8)
    x = sample("lognormal", (64, 64), g, torch.float32)
    x[::3] *= 1e-37  # subnormal and near-subnormal values, in blocks next to normal ones
    x[1, :8] = torch.tensor([1e-39, -1e-40, 1e-45, 0.0, 2e-38, -3e-39, 1e-38, 5e-39])
    tiny = sample("normal", (4, 32), g, torch.float32) * 1e-35  # a per-tensor scale clamped to 2**-100
    want = [nvfp4.quantize(t, backend=b) for t in (x, tiny) for b in ("reference", "cpu")]
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        got = [nvfp4.quantize(t, backend=b) for t in (x, tiny) for b in ("reference", "cpu")]
        deq = [nvfp4.dequantize(q, torch.float16, backend="cpu") for q in got]
    finally:
        torch.set_flush_denormal(False)
    for a, b in zip(got, want):
        assert_same_q(a, b)
    for d, q in zip(deq, want):
        assert same_bits(d, nvfp4.dequantize(q, torch.float16, backend="reference"))


_COMPILE_CHECK = """
import re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from syncd.ops.triton_kernels import nvfp4 as k

target = GPUTarget("cuda", 90, 32)
for kind, ptr in enumerate(["*i16", "*fp16", "*fp32"]):
    quant = ASTSource(fn=k._quantize_kernel, constexprs={"IN_KIND": kind, "BB": k.BLOCKS_PER_PROGRAM},
                      signature={"x_ptr": ptr, "pts_ptr": "*fp32", "q_ptr": "*u8", "s_ptr": "*u8", "bad_ptr": "*i32",
                                 "n_blocks": "i64", "IN_KIND": "constexpr", "BB": "constexpr"})
    deq = ASTSource(fn=k._dequantize_kernel, constexprs={"OUT_KIND": kind, "BB": k.BLOCKS_PER_PROGRAM},
                    signature={"q_ptr": "*u8", "s_ptr": "*u8", "pts_ptr": "*fp32",
                               "out_ptr": "*i16" if kind < 2 else "*fp32", "n_blocks": "i64", "OUT_KIND": "constexpr",
                               "BB": "constexpr"})
    for name, src in (("quantize", quant), ("dequantize", deq)):
        ptx = triton.compile(src, target=target, options={"enable_fp_fusion": False}).asm["ptx"]
        ops = sorted(set(re.findall(r"\\b(?:fma|div|rcp|mul|add|sub)\\.[a-z0-9.]*f32\\b", ptx)))
        print(name, kind, " ".join(ops), "sixth" if "0f3E2AAAAB" in ptx else "")
"""


def test_triton_kernels_compile_for_a_gpu_with_ieee_arithmetic():
    """The interpreter accepts code the compiler rejects, and approximate division or fused multiply-adds
    would change bits on a GPU: compile both kernels for sm_90 (no GPU needed; a subprocess, since this one
    runs Triton interpreted) and read their PTX."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-c", _COMPILE_CHECK], env=env, capture_output=True, text=True,
                          timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.split("\n")
    lines = [ln.split() for ln in lines if ln.strip()]
    assert len(lines) == 6
    for name, _kind, *ops in lines:
        fops = [op for op in ops if op != "sixth"]
        # round-to-nearest multiply/add/divide only: no fused multiply-add, no approximate division or reciprocal
        assert fops and all(op.split(".")[0] in ("mul", "add", "sub", "div") and ".rn." in op for op in fops), (name, ops)
        assert (name == "quantize") == ("sixth" in ops)  # the float32 constant 1/6 = 0x3E2AAAAB
