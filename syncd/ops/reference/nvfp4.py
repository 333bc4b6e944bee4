"""NVFP4 quantization in plain PyTorch: the executable specification every backend is tested against.

The recipe is FlashInfer's / vLLM's ``scaled_fp4_quant`` in its own order of operations, as vLLM states it
in Python (``ref_nvfp4_quant`` in ``vllm/model_executor/layers/quantization/utils/nvfp4_emulation_utils.py``),
with every reciprocal an IEEE-rounded ``1 / x`` (the CUDA kernels use ``rcp.approx.ftz``; see
``docs/nvfp4.md``). All arithmetic is float32 with round-to-nearest-even; there is no fused multiply-add.
For a tensor ``x`` whose last dimension is cut into blocks of 16 and a per-tensor scale ``pts`` (decode
convention, ``amax / (448 * 6)``)::

    gs  = 1 / pts                       # the recipe's global (encode) scale
    rgs = 1 / gs
    sf  = e4m3(min(gs * (max|block| * fp32(1/6)), 448))       # round to nearest even, saturating
    os  = 0 if sf == 0 else 1 / (sf * rgs)
    code(x) = e2m1(x * os)             # nearest even of {0, .5, 1, 1.5, 2, 3, 4, 6}, saturating at 6, sign kept

Codes are nibbles (bit 3 the sign, bits 0-2 the magnitude index), element ``2j`` in the low nibble of byte
``j``; block scales are float8_e4m3fn bytes. Dequantization is ``e2m1_value(code) * (float(sf) * pts)`` in
float32, then rounded to the output dtype (nearest even).

Edge cases (see ``docs/nvfp4.md``): an all-zero block (or one whose scale underflows E4M3) gets scale 0 and
codes of magnitude 0 with each input's sign (-0.0 and negative values that round to zero give code 8);
``per_tensor_scale`` computed from a tensor is ``amax / 2688`` clamped to [2**-100, 2**100] (so an all-zero
tensor gets 2**-100, zero scales and zero codes); NaN or infinite inputs raise ``ValueError``.

The constants (block size, maxima, scale range) and the swizzled scale layout are ``syncd/ops/_nvfp4_format.py``.
"""

from __future__ import annotations

import torch

from syncd.ops._nvfp4_format import AMAX_PER_SCALE, BLOCK, E4M3_MAX, PTS_MAX, PTS_MIN

#: value of each 4-bit code: index 0-7 the magnitudes, 8-15 their negatives (8 is -0.0)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
#: round to nearest even: a magnitude ``a`` gets index sum(a > t or a >= t) over these (threshold, inclusive)
E2M1_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True),
                   (5.0, False))


def check_finite(x: torch.Tensor) -> None:
    """Raise ``ValueError`` if ``x`` holds a NaN or an infinity (NVFP4 has neither)."""
    if x.numel() and not bool(torch.isfinite(x).all()):
        raise ValueError("NVFP4 quantize: the input holds NaN or infinite values, which NVFP4 cannot represent")


def per_tensor_scale(x: torch.Tensor) -> torch.Tensor:
    """float32 0-dim tensor ``clamp(amax(|x|) / 2688, 2**-100, 2**100)`` (the decode-convention scale that
    maps the tensor's largest magnitude to 6 * 448). Raises ``ValueError`` on NaN/Inf."""
    check_finite(x)
    amax = x.detach().abs().amax().float() if x.numel() else torch.zeros((), dtype=torch.float32)
    return torch.clamp(amax / AMAX_PER_SCALE, PTS_MIN, PTS_MAX).reshape(())


def e4m3_codes(v: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn bit patterns (uint8) of non-negative float32 ``v``: nearest even, saturating at 448."""
    return torch.clamp(v.float(), max=E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def e2m1_codes(s: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 codes (uint8) of float32 ``s``: nearest even, saturating at +-6, sign bit kept."""
    a = s.abs()
    mag = torch.zeros(s.shape, dtype=torch.uint8)
    for t, inclusive in E2M1_THRESHOLDS:
        mag += (a >= t if inclusive else a > t).to(torch.uint8)
    return mag | (torch.signbit(s).to(torch.uint8) << 3)


def global_scales(pts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gs, rgs) = (1 / pts, 1 / gs), float32."""
    pts = pts.float().reshape(())
    gs = torch.reciprocal(pts)
    return gs, torch.reciprocal(gs)


def quantize(x: torch.Tensor, pts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(qdata uint8 [..., K/2], scales float8_e4m3fn [..., K/16]) of ``x`` [..., K] (K % 16 == 0) with
    per-tensor scale ``pts``. The caller validates ``x`` (finite, shape) and ``pts`` (in range)."""
    shape = x.shape
    k = shape[-1]
    blocks = x.detach().cpu().float().reshape(-1, k // BLOCK, BLOCK)
    gs, rgs = global_scales(pts.cpu())
    vmax = blocks.abs().amax(dim=-1)
    sf_code = e4m3_codes(gs * (vmax * torch.tensor(1.0 / 6.0, dtype=torch.float32)))
    sf = sf_code.view(torch.float8_e4m3fn).float()
    os = torch.where(sf == 0, torch.zeros_like(sf), torch.reciprocal(sf * rgs))
    codes = e2m1_codes(blocks * os.unsqueeze(-1)).reshape(-1, k)
    qdata = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return qdata.reshape(*shape[:-1], k // 2), sf_code.view(torch.float8_e4m3fn).reshape(*shape[:-1], k // BLOCK)


def unpack_codes(qdata: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., 2 * n] from packed bytes [..., n] (low nibble first)."""
    q = qdata.cpu()
    return torch.stack([q & 0xF, q >> 4], dim=-1).reshape(*q.shape[:-1], 2 * q.shape[-1])


def dequantize(qdata: torch.Tensor, scales: torch.Tensor, pts: torch.Tensor,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``e2m1_value(code) * (float(scale) * pts)`` in float32, rounded to ``dtype``; ``scales`` linear
    [..., K/16] float8_e4m3fn, ``qdata`` [..., K/2] uint8."""
    codes = unpack_codes(qdata)
    k = codes.shape[-1]
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32)[codes.long()].reshape(-1, k // BLOCK, BLOCK)
    block = scales.cpu().reshape(-1, k // BLOCK).float() * pts.cpu().float().reshape(())
    return (values * block.unsqueeze(-1)).reshape(codes.shape).to(dtype)
