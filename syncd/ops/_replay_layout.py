"""Layout facts of the replay ops' data, shared by the ops (``syncd.ops.replay``) and their specification
(``syncd/ops/reference/replay.py``): the row of every entry of a CSR list of kept sets, the width of a packed
expert id, and the salt of the kept-set fingerprint. Pure functions; tensors stay on their device.
"""

from __future__ import annotations

import torch

#: xored into every id before the fingerprint's mix
FINGERPRINT_SALT = 0x9E3779B9


def kept_rows(offsets: torch.Tensor) -> torch.Tensor:
    """The row of every kept entry of CSR ``offsets`` (integer ``[T + 1]``, rising from 0): int64 ``[offsets[-1]]``
    on ``offsets``' device (``repeat_interleave`` of the row sizes)."""
    sizes = (offsets[1:] - offsets[:-1]).to(torch.int64)
    return torch.repeat_interleave(torch.arange(sizes.numel(), device=offsets.device), sizes)


def bits_per_id(num_experts: int) -> int:
    """Bits of one expert id: ``max(1, ceil(log2 num_experts))``."""
    return max(1, (int(num_experts) - 1).bit_length())
