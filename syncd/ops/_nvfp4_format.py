"""NVFP4's fixed facts (``docs/nvfp4.md``), shared by the ops (``syncd.ops.nvfp4``) and their specification
(``syncd/ops/reference/nvfp4.py``): the block of 16, the E2M1 and E4M3 maxima, the range of the per-tensor scale,
the dtypes quantized from and to, and the 128x4 swizzled layout of the block scales. Pure functions of tensors on
any device.
"""

from __future__ import annotations

import torch

#: elements per block scale
BLOCK = 16
#: the largest E2M1 code value and the largest finite float8_e4m3fn
E2M1_MAX = 6.0
E4M3_MAX = 448.0
#: the largest amax a per-tensor scale of 1 can represent (448 * 6)
AMAX_PER_SCALE = E4M3_MAX * E2M1_MAX
#: the range of a per-tensor scale (decode convention, ``amax / 2688``)
PTS_MIN = 2.0 ** -100
PTS_MAX = 2.0 ** 100
#: what quantize reads and dequantize writes
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
OUTPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def swizzled_shape(rows: int, cols: int) -> tuple[int, int]:
    """(rows rounded up to 128, cols rounded up to 4): the padded size of the 128x4 swizzled layout."""
    return (rows + 127) // 128 * 128, (cols + 3) // 4 * 4


def swizzle(scales: torch.Tensor) -> torch.Tensor:
    """The 128x4 tiled layout GEMMs read (cuBLAS' block-scaling-factor layout, FlashInfer/vLLM
    ``swizzle_blockscale``): per matrix [M, S] (leading dimensions are kept), zero-padded to
    [Mp, Sp] = [ceil(M/128)*128, ceil(S/4)*4]; scale (r, c) goes to tile (r // 128, c // 4), in row-major
    tile order, at offset (r % 32) * 16 + ((r // 32) % 4) * 4 + c % 4 within the tile's 512 bytes."""
    *lead, m, s = scales.shape
    mp, sp = swizzled_shape(m, s)
    padded = torch.zeros((*lead, mp, sp), dtype=scales.dtype, device=scales.device)
    padded[..., :m, :s] = scales
    n = len(lead)
    t = padded.reshape(*lead, mp // 128, 4, 32, sp // 4, 4)
    t = t.permute(*range(n), n, n + 3, n + 2, n + 1, n + 4)
    return t.reshape(*lead, mp, sp)


def unswizzle(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`swizzle`: the linear [..., rows, cols] scales (the padding is dropped)."""
    *lead, mp, sp = swizzled.shape
    n = len(lead)
    t = swizzled.reshape(*lead, mp // 128, sp // 4, 32, 4, 4)
    t = t.permute(*range(n), n, n + 3, n + 2, n + 1, n + 4)
    return t.reshape(*lead, mp, sp)[..., :rows, :cols]
