"""The integer word views ``syncd.engine.WeightUpdater`` compares and writes through (:func:`word_view`,
:func:`flat_view`, :func:`bf16_view_of_fp32`). Pure functions; thread-safe.

How local parameters map onto the trainer's tensors is the engine contract's (:mod:`syncd.engines.params`).
"""

from __future__ import annotations

import torch

__all__ = ["bf16_view_of_fp32", "word_view", "flat_view"]

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def word_view(flat: torch.Tensor) -> torch.Tensor:
    """A 1-D view of ``flat``'s elements as integers of the same width (bit-exact compares and copies)."""
    return flat.view(_INT_OF_WIDTH[flat.element_size()])


def flat_view(t: torch.Tensor, name: str) -> torch.Tensor:
    try:
        return t.detach().view(-1)
    except RuntimeError:
        raise ValueError(f"local tensor {name!r} cannot be flattened without a copy (strides "
                         f"{tuple(t.stride())} for shape {tuple(t.shape)}); pass a view that can") from None


def bf16_view_of_fp32(t: torch.Tensor) -> torch.Tensor:
    """The bf16 words of an fp32 tensor whose values are all bf16-exact (low 16 bits zero), as a bf16 view
    of the same shape sharing its memory: writing a bf16 word through it sets the fp32 value exactly.
    Little-endian hosts only (the bf16 word is the high half of each fp32 word)."""
    if t.dtype != torch.float32:
        raise ValueError(f"bf16_view_of_fp32 needs a float32 tensor, got {t.dtype}")
    import sys
    if sys.byteorder != "little":  # pragma: no cover
        raise ValueError("bf16_view_of_fp32 needs a little-endian host")
    if not t.is_contiguous():
        raise ValueError("bf16_view_of_fp32 needs a contiguous tensor")
    return t.detach().view(torch.bfloat16)[..., 1::2] if t.dim() else t.detach().view(1).view(torch.bfloat16)[1]
