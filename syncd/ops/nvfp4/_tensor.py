"""``NVFP4Tensor``: packed E2M1 codes, E4M3 block scales and a float32 per-tensor scale, plus the conversions
between the linear and the 128x4 swizzled scale layouts."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from syncd.ops._nvfp4_format import BLOCK, swizzle, swizzled_shape, unswizzle


@dataclass(frozen=True, eq=False)
class NVFP4Tensor:
    """An NVFP4 tensor of logical shape ``shape`` = [..., K] (K a multiple of 16).

    - ``qdata``: uint8 [..., K/2]; element 2j in the low nibble of byte j, 2j+1 in the high nibble; a code's
      bit 3 is the sign, bits 0-2 index {0, 0.5, 1, 1.5, 2, 3, 4, 6}.
    - ``scales``: float8_e4m3fn block scales, one per 16 elements: linear [..., K/16], or, when
      ``swizzled``, the 128x4 tiled layout GEMMs read, [..., ceil(M/128)*128, ceil(K/64)*4] per matrix
      [M, K] (leading dimensions kept; a 1-d tensor is one row), zero-padded.
    - ``per_tensor_scale``: float32 0-dim tensor, decode convention: value = code * scale * per_tensor_scale.

    All three live on one device. Construction checks shapes and dtypes and raises ``ValueError``.
    """

    qdata: torch.Tensor
    scales: torch.Tensor
    per_tensor_scale: torch.Tensor
    swizzled: bool = False

    def __post_init__(self):
        q, s, p = self.qdata, self.scales, self.per_tensor_scale
        if q.dtype != torch.uint8 or q.dim() < 1 or q.shape[-1] % (BLOCK // 2):
            raise ValueError(f"NVFP4 qdata must be uint8 [..., K/2] with K a multiple of 16; got {q.dtype} "
                             f"{tuple(q.shape)}")
        if s.dtype != torch.float8_e4m3fn:
            raise ValueError(f"NVFP4 scales must be float8_e4m3fn, got {s.dtype}")
        if p.dtype != torch.float32 or p.numel() != 1:
            raise ValueError(f"NVFP4 per_tensor_scale must be one float32 value, got {p.dtype} {tuple(p.shape)}")
        if not (q.device == s.device == p.device):
            raise ValueError(f"NVFP4 parts on different devices: qdata {q.device}, scales {s.device}, "
                             f"per_tensor_scale {p.device}")
        want = self.scales_shape(self.swizzled)
        if tuple(s.shape) != want:
            raise ValueError(f"NVFP4 scales of shape {tuple(s.shape)} do not fit qdata {tuple(q.shape)} "
                             f"({'swizzled' if self.swizzled else 'linear'} layout needs {want})")
        if p.dim():
            object.__setattr__(self, "per_tensor_scale", p.reshape(()))

    @property
    def shape(self) -> torch.Size:
        """The logical shape [..., K] of the values."""
        return torch.Size((*self.qdata.shape[:-1], 2 * self.qdata.shape[-1]))

    @property
    def device(self) -> torch.device:
        return self.qdata.device

    @property
    def nbytes(self) -> int:
        """Bytes of the three parts (what a full copy ships)."""
        return sum(t.numel() * t.element_size() for t in (self.qdata, self.scales, self.per_tensor_scale))

    def scales_shape(self, swizzled: bool) -> tuple[int, ...]:
        shape = self.shape
        cols = shape[-1] // BLOCK
        if not swizzled:
            return (*shape[:-1], cols)
        rows = shape[-2] if len(shape) >= 2 else 1
        lead = tuple(shape[:-2])
        return (*lead, *swizzled_shape(rows, cols))

    def to_swizzled(self) -> "NVFP4Tensor":
        """The same tensor with swizzled scales (itself if they already are)."""
        if self.swizzled:
            return self
        return NVFP4Tensor(self.qdata, swizzle_scales(self.scales), self.per_tensor_scale, swizzled=True)

    def to_linear(self) -> "NVFP4Tensor":
        """The same tensor with linear scales (itself if they already are)."""
        if not self.swizzled:
            return self
        return NVFP4Tensor(self.qdata, unswizzle_scales(self.scales, self.shape), self.per_tensor_scale)

    def to(self, device) -> "NVFP4Tensor":
        return NVFP4Tensor(self.qdata.to(device), self.scales.to(device), self.per_tensor_scale.to(device),
                           self.swizzled)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16, *, out: torch.Tensor | None = None,
                   backend: str = "auto") -> torch.Tensor:
        """See :func:`syncd.ops.nvfp4.dequantize`."""
        from syncd.ops.nvfp4._quant import dequantize

        return dequantize(self, dtype, out=out, backend=backend)


def _as_matrix(scales: torch.Tensor) -> torch.Tensor:
    return scales.reshape(1, -1) if scales.dim() == 1 else scales


def swizzle_scales(scales: torch.Tensor) -> torch.Tensor:
    """Linear block scales [..., M, K/16] (or [K/16]) to the 128x4 swizzled layout
    [..., ceil(M/128)*128, ceil(K/64)*4], zero-padded; any device. See ``docs/nvfp4.md``."""
    if scales.dim() < 1:
        raise ValueError("block scales need at least one dimension")
    u8 = _as_matrix(scales.view(torch.uint8))
    return swizzle(u8).view(scales.dtype)


def unswizzle_scales(swizzled: torch.Tensor, shape) -> torch.Tensor:
    """Swizzled block scales back to linear [..., M, K/16] for values of logical ``shape`` [..., M, K]."""
    shape = tuple(shape)
    cols = shape[-1] // BLOCK
    rows = shape[-2] if len(shape) >= 2 else 1
    want = (*shape[:-2], *swizzled_shape(rows, cols))
    if tuple(swizzled.shape) != want:
        raise ValueError(f"swizzled scales of shape {tuple(swizzled.shape)} do not fit values of shape {shape} "
                         f"(expected {want})")
    lin = unswizzle(swizzled.view(torch.uint8), rows, cols).contiguous()
    return lin.reshape(*shape[:-1], cols).view(swizzled.dtype)
