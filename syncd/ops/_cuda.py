"""Launch wrappers for the CUDA C++ kernels in ``syncd._cuda_native`` (``csrc/cuda/``). Same contracts as
``syncd.ops.triton_kernels``: tensors stay on the device; kernels run on torch's current stream."""

from __future__ import annotations

import torch

from syncd.ops import _backend
from syncd.ops import _checksum_math as ck
from syncd.ops._tensors import int_view



def _stream(t: torch.Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream


def checksum(t: torch.Tensor) -> int:
    b = t.reshape(-1).view(torch.uint8)
    if b.data_ptr() % 16:  # the kernel's 16-byte loads need an aligned start; views into buffers may not be
        b = b.clone()
    out = torch.zeros(1, dtype=torch.int64, device=t.device)
    _backend.cuda_native().checksum_raw(b.data_ptr(), b.numel(), out.data_ptr(), _stream(t))
    return ck.finalize(int(out.item()) & ck.MASK64, b.numel())


def find_changes(old: torch.Tensor, new: torch.Tensor, bits: int, is_float: bool):
    mod = _backend.cuda_native()
    a = int_view(old.detach().reshape(-1))
    b = int_view(new.detach().reshape(-1))
    n = a.numel()
    tile = mod.SCAN_TILE
    grid = max(1, (n + tile - 1) // tile)
    counts = torch.zeros(grid, dtype=torch.int64, device=a.device)
    s = _stream(a)
    if n:
        mod.count_changes(a.data_ptr(), b.data_ptr(), n, bits, counts.data_ptr(), s)
    offsets = torch.cumsum(counts, 0)
    total = int(offsets[-1].item()) if n else 0
    offsets -= counts
    pos = torch.empty(total, dtype=torch.int64, device=a.device)
    v = torch.empty(total, dtype=torch.int64, device=a.device)
    if total:
        mod.compact_changes(a.data_ptr(), b.data_ptr(), n, bits, is_float, offsets.data_ptr(), pos.data_ptr(),
                            v.data_ptr(), s)
    return pos, v


def scatter_apply(target: torch.Tensor, pos: torch.Tensor, v: torch.Tensor, bits: int, is_float: bool,
                  forward: bool = True) -> None:
    m = pos.numel()
    if not m:
        return
    t = target.view(-1) if target.dim() else target.view(1)
    _backend.cuda_native().scatter_apply(t.data_ptr(), pos.data_ptr(), v.data_ptr(), m, bits, is_float, forward,
                                         _stream(target))
