"""Launch wrappers for the CUDA NVFP4 kernels in ``syncd._cuda_native`` (``csrc/cuda/nvfp4.cu``). Same
contracts as ``syncd.ops.triton_kernels.nvfp4``: contiguous tensors on one CUDA device, torch's current
stream."""

from __future__ import annotations

import torch

from syncd.ops import _backend

_CODE = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}


def _stream(t: torch.Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` if its data starts on a 16-byte boundary (the kernels' vector loads need it), else a copy."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


def quantize(x: torch.Tensor, pts: torch.Tensor, qdata: torch.Tensor, scales_u8: torch.Tensor) -> bool:
    """Fill ``qdata`` and ``scales_u8`` from ``x``; True if ``x`` holds NaN or infinite values (a sync)."""
    n_blocks = x.numel() // 16
    bad = torch.zeros(1, dtype=torch.int32, device=x.device)
    if n_blocks:
        x = _aligned(x)
        _backend.cuda_native().nvfp4_quantize_raw(x.data_ptr(), n_blocks, _CODE[x.dtype], pts.data_ptr(),
                                                  qdata.data_ptr(), scales_u8.data_ptr(), bad.data_ptr(), _stream(x))
    return bool(bad.item())


def dequantize(qdata: torch.Tensor, scales_u8: torch.Tensor, pts: torch.Tensor, out: torch.Tensor) -> None:
    """Fill contiguous ``out`` from ``qdata`` and linear ``scales_u8`` (through an aligned temporary when
    ``out`` is a view that does not start on a 16-byte boundary)."""
    n_blocks = out.numel() // 16
    if not n_blocks:
        return
    qdata = _aligned(qdata)
    target = out if out.data_ptr() % 16 == 0 else torch.empty_like(out)
    _backend.cuda_native().nvfp4_dequantize_raw(qdata.data_ptr(), scales_u8.data_ptr(), n_blocks, pts.data_ptr(),
                                                target.data_ptr(), _CODE[out.dtype], _stream(out))
    if target is not out:
        out.copy_(target)
