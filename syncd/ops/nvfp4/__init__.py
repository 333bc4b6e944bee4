"""NVFP4: one quantizer, bit for bit, for the trainer's QAT and the engines' low-precision weights.

``quantize(x, *, per_tensor_scale=None, swizzle=False, backend="auto") -> NVFP4Tensor`` follows the
FlashInfer / vLLM recipe in its order of operations (E2M1 codes in blocks of 16 with an E4M3 block scale and
a float32 per-tensor scale; round to nearest even, saturating); ``dequantize(q, dtype)`` is its inverse up to
rounding. Every backend (``reference`` plain PyTorch, ``cpu`` native, ``triton``, ``cuda``) returns the same
bits. The format, the edge cases and the state-dict naming are in ``docs/nvfp4.md``.

- :func:`quantize`, :func:`dequantize`, :func:`per_tensor_scale`, :class:`NVFP4Tensor`
- :func:`swizzle_scales` / :func:`unswizzle_scales`: linear <-> the 128x4 layout GEMMs read
- state dicts: :func:`quantize_state_dict` (what a trainer publishes), :func:`load_state_dict` /
  :func:`dequantize_state_dict` (what an engine loads), :func:`nvfp4_names`, :func:`is_linear_weight`
"""

from syncd.ops.nvfp4._quant import dequantize, per_tensor_scale, quantize
from syncd.ops.nvfp4._state_dict import (
    PER_TENSOR_SCALE,
    QDATA,
    SCALES,
    SUFFIXES,
    dequantize_state_dict,
    is_linear_weight,
    load_state_dict,
    nvfp4_names,
    quantize_state_dict,
)
from syncd.ops.nvfp4._tensor import BLOCK, NVFP4Tensor, swizzle_scales, unswizzle_scales

__all__ = [
    "BLOCK", "NVFP4Tensor", "PER_TENSOR_SCALE", "QDATA", "SCALES", "SUFFIXES", "dequantize",
    "dequantize_state_dict", "is_linear_weight", "load_state_dict", "nvfp4_names", "per_tensor_scale", "quantize",
    "quantize_state_dict", "swizzle_scales", "unswizzle_scales",
]
