"""Format 2's context of an old tensor computed where the tensor lives (torch ops on any device): each block's
``e_top`` and every element's class, two per byte. The GPU backends send these few bytes to the host codec
instead of the tensor; the rule is ``syncd/ops/reference/context.py`` (the tests check that both agree).
"""

from __future__ import annotations

import torch

from syncd.ops import _format as fmt
from syncd.ops._tensors import int_view



def exponent_field(t: torch.Tensor, dt: fmt.DType) -> torch.Tensor:
    """The exponent field of every element of ``t`` (flattened) as int16; zeros for integer dtypes."""
    flat = t.detach().reshape(-1)
    if not dt.exp_bits:
        return torch.zeros(flat.numel(), dtype=torch.int16, device=t.device)
    bits = int_view(flat)
    wide = bits.to(torch.int32) if dt.bits < 32 else bits
    return ((wide >> dt.exp_shift) & ((1 << dt.exp_bits) - 1)).to(torch.int16)


def choose_e_tops(exps: torch.Tensor, dt: fmt.DType, block_log2: int) -> torch.Tensor:
    """Every block's encoder ``e_top`` (int64): the largest sampled exponent field that is not all ones."""
    numel = exps.numel()
    n_blocks = max(1, (numel + (1 << block_log2) - 1) >> block_log2)
    if not dt.exp_bits or not numel:
        return torch.zeros(n_blocks, dtype=torch.int64, device=exps.device)
    period = min(1 << block_log2, fmt.SAMPLE_PERIOD)
    run = min(fmt.SAMPLE_RUN, period)
    e = exps.to(torch.int32)
    e = torch.where(e == (1 << dt.exp_bits) - 1, -1, e)
    rows = (numel + period - 1) // period
    e = torch.nn.functional.pad(e, (0, rows * period - numel), value=-1).view(rows, period)[:, :run]
    row_max = e.amax(dim=1)
    per_block = (1 << block_log2) // period
    row_max = torch.nn.functional.pad(row_max, (0, n_blocks * per_block - rows), value=-1)
    return row_max.view(n_blocks, per_block).amax(dim=1).clamp(min=0).to(torch.int64)


def class_nibbles(t: torch.Tensor, dt: fmt.DType, block_log2: int,
                  e_tops: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(nibbles, e_tops)`` of ``t`` on its device: classes ``clamp(e_top - E, 0, 15)`` two per byte (element
    ``2i`` in the low nibble of byte ``i``). ``e_tops`` (one per block) are chosen as an encoder does when not
    given; a decoder passes the blob's."""
    exps = exponent_field(t, dt)
    numel = exps.numel()
    if e_tops is None:
        e_tops = choose_e_tops(exps, dt, block_log2)
    e_tops = e_tops.to(device=exps.device, dtype=torch.int16)
    bs = 1 << block_log2
    full = numel // bs
    cls = torch.empty(numel + (numel & 1), dtype=torch.uint8, device=exps.device)
    if full:
        cls[: full * bs].view(full, bs).copy_((e_tops[:full, None] - exps[: full * bs].view(full, bs)).clamp(0, 15))
    if full * bs < numel:
        cls[full * bs : numel] = (e_tops[full] - exps[full * bs :]).clamp(0, 15)
    if numel & 1:
        cls[numel] = 0
    return cls[0::2] | (cls[1::2] << 4), e_tops.to(torch.int64)
