"""Triton kernels of NVFP4 quantize and dequantize: the same bits as the reference
(``syncd/ops/reference/nvfp4.py``), with every division ``div_rn`` (IEEE; Triton's ``/`` is approximate on
NVIDIA GPUs) and fused multiply-adds disabled.

Runs on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1``. Launch-level functions take
contiguous torch tensors on one device and a float32 per-tensor scale tensor there; they do not validate
(``syncd.ops.nvfp4`` does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCKS_PER_PROGRAM = 128
_IN_KIND = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_SIXTH = tl.constexpr(1.0 / 6.0)  # fp32(1/6) in the kernels (float32 arithmetic), the recipe's reciprocal of 6


@triton.jit
def _e4m3_code(v):
    """float8_e4m3fn bits (uint32) of non-negative float32 ``v``: nearest even, saturating at 448."""
    v = tl.minimum(v, 448.0)
    b = v.to(tl.uint32, bitcast=True)
    # below 2^-6: adding 2^14 (ulp 2^-9) rounds to the subnormal grid; 0x46800000 is the bits of 2^14
    sub = (v + 16384.0).to(tl.uint32, bitcast=True) - 0x46800000
    nrm = ((b + 0x7FFFF + ((b >> 20) & 1)) >> 20) - 960
    return tl.where(b < 0x3C800000, sub, nrm)


@triton.jit
def _e4m3_value(c):
    nrm = ((((c >> 3) + 120) << 23) | ((c & 7) << 20)).to(tl.float32, bitcast=True)
    return tl.where(c < 8, c.to(tl.float32) * 0.001953125, nrm)


@triton.jit
def _e2m1_code(s):
    b = s.to(tl.uint32, bitcast=True)
    a = (b & 0x7FFFFFFF).to(tl.float32, bitcast=True)
    m = ((a > 0.25).to(tl.uint32) + (a >= 0.75).to(tl.uint32) + (a > 1.25).to(tl.uint32)
         + (a >= 1.75).to(tl.uint32) + (a > 2.5).to(tl.uint32) + (a >= 3.5).to(tl.uint32) + (a > 5.0).to(tl.uint32))
    return m | ((b >> 28) & 8)


@triton.jit
def _e2m1_value(c):
    m = c & 7
    v = tl.where(m < 4, m.to(tl.float32) * 0.5, tl.where(m == 7, 6.0, (m - 2).to(tl.float32)))
    return tl.where((c & 8) != 0, -v, v)


@triton.jit
def _load_f32(ptr, idx, mask, IN_KIND: tl.constexpr):
    if IN_KIND == 0:  # bfloat16, passed as its int16 bits
        h = tl.load(ptr + idx, mask=mask, other=0).to(tl.uint16, bitcast=True).to(tl.uint32)
        return (h << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr + idx, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _bf16_bits(y):
    b = y.to(tl.uint32, bitcast=True)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def _f16_bits(y):
    b = y.to(tl.uint32, bitcast=True)
    sign = (b >> 16) & 0x8000
    a = b & 0x7FFFFFFF
    nrm = ((a + 0xFFF + ((a >> 13) & 1)) - 0x38000000) >> 13
    sub = (a.to(tl.float32, bitcast=True) + 0.5).to(tl.uint32, bitcast=True) - 0x3F000000
    mag = tl.where(a >= 0x477FF000, 0x7C00, tl.where(a >= 0x38800000, nrm, sub))
    return (sign | mag).to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def _quantize_kernel(x_ptr, pts_ptr, q_ptr, s_ptr, bad_ptr, n_blocks, IN_KIND: tl.constexpr, BB: tl.constexpr):
    pid = tl.program_id(0)
    blk = pid.to(tl.int64) * BB + tl.arange(0, BB)
    bmask = blk < n_blocks
    j = tl.arange(0, 8)
    m2 = bmask[:, None] & (j[None, :] < 8)
    even = blk[:, None] * 16 + 2 * j[None, :]
    xe = _load_f32(x_ptr, even, m2, IN_KIND)
    xo = _load_f32(x_ptr, even + 1, m2, IN_KIND)
    ae = xe.to(tl.uint32, bitcast=True) & 0x7FFFFFFF
    ao = xo.to(tl.uint32, bitcast=True) & 0x7FFFFFFF
    amax = tl.max(tl.maximum(ae, ao), axis=1)  # magnitudes compare as integers
    nonfinite = tl.max(tl.where(m2 & ((ae >= 0x7F800000) | (ao >= 0x7F800000)), 1, 0))
    pts = tl.load(pts_ptr)
    gs = tl.math.div_rn(1.0, pts)
    rgs = tl.math.div_rn(1.0, gs)
    sf_code = _e4m3_code(gs * (amax.to(tl.float32, bitcast=True) * _SIXTH))
    sf = _e4m3_value(sf_code)
    den = tl.where(sf == 0.0, 1.0, sf * rgs)  # (no division by zero, also in the interpreter)
    os = tl.where(sf == 0.0, 0.0, tl.math.div_rn(tl.full(sf.shape, 1.0, tl.float32), den))
    code = _e2m1_code(xe * os[:, None]) | (_e2m1_code(xo * os[:, None]) << 4)
    tl.store(q_ptr + blk[:, None] * 8 + j[None, :], code.to(tl.uint8), mask=m2)
    tl.store(s_ptr + blk, sf_code.to(tl.uint8), mask=bmask)
    tl.atomic_max(bad_ptr, nonfinite)


@triton.jit
def _dequantize_kernel(q_ptr, s_ptr, pts_ptr, out_ptr, n_blocks, OUT_KIND: tl.constexpr, BB: tl.constexpr):
    pid = tl.program_id(0)
    blk = pid.to(tl.int64) * BB + tl.arange(0, BB)
    bmask = blk < n_blocks
    j = tl.arange(0, 8)
    m2 = bmask[:, None] & (j[None, :] < 8)
    byte = tl.load(q_ptr + blk[:, None] * 8 + j[None, :], mask=m2, other=0).to(tl.uint32)
    sc = tl.load(s_ptr + blk, mask=bmask, other=0).to(tl.uint32)
    scale = (_e4m3_value(sc) * tl.load(pts_ptr))[:, None]
    ye = _e2m1_value(byte & 15) * scale
    yo = _e2m1_value(byte >> 4) * scale
    even = blk[:, None] * 16 + 2 * j[None, :]
    if OUT_KIND == 0:
        tl.store(out_ptr + even, _bf16_bits(ye), mask=m2)
        tl.store(out_ptr + even + 1, _bf16_bits(yo), mask=m2)
    elif OUT_KIND == 1:
        tl.store(out_ptr + even, _f16_bits(ye), mask=m2)
        tl.store(out_ptr + even + 1, _f16_bits(yo), mask=m2)
    else:
        tl.store(out_ptr + even, ye, mask=m2)
        tl.store(out_ptr + even + 1, yo, mask=m2)


def _as_kernel_input(t: torch.Tensor) -> torch.Tensor:
    """bfloat16 and float16 go in as int16 bits / float16 (the interpreter has no bfloat16)."""
    flat = t.reshape(-1)
    return flat.view(torch.int16) if t.dtype == torch.bfloat16 else flat


def quantize(x: torch.Tensor, pts: torch.Tensor, qdata: torch.Tensor, scales_u8: torch.Tensor) -> bool:
    """Fill ``qdata`` (uint8, numel/2) and ``scales_u8`` (uint8, numel/16) from contiguous ``x``; True if
    ``x`` holds NaN or infinite values (a device-to-host sync)."""
    n_blocks = x.numel() // 16
    bad = torch.zeros(1, dtype=torch.int32, device=x.device)
    if n_blocks:
        grid = (triton.cdiv(n_blocks, BLOCKS_PER_PROGRAM),)
        _quantize_kernel[grid](_as_kernel_input(x), pts, qdata, scales_u8, bad, n_blocks,
                               IN_KIND=_IN_KIND[x.dtype], BB=BLOCKS_PER_PROGRAM, enable_fp_fusion=False)
    return bool(bad.item())


def dequantize(qdata: torch.Tensor, scales_u8: torch.Tensor, pts: torch.Tensor, out: torch.Tensor) -> None:
    """Fill contiguous ``out`` (bfloat16, float16 or float32) from ``qdata`` and linear ``scales_u8``."""
    n_blocks = out.numel() // 16
    if not n_blocks:
        return
    kind = _IN_KIND[out.dtype]
    target = out.reshape(-1).view(torch.int16) if kind in (0, 1) else out.reshape(-1)
    grid = (triton.cdiv(n_blocks, BLOCKS_PER_PROGRAM),)
    _dequantize_kernel[grid](qdata, scales_u8, pts, target, n_blocks, OUT_KIND=kind, BB=BLOCKS_PER_PROGRAM,
                             enable_fp_fusion=False)
