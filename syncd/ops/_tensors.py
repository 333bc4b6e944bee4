"""Zero-copy views of torch tensors as NumPy byte arrays, for the native and reference backends."""

from __future__ import annotations

import numpy as np
import torch


def byte_view(t: torch.Tensor) -> np.ndarray:
    """The bytes of a CPU tensor as a 1-d uint8 NumPy array. Shares memory when ``t`` is contiguous (so
    writes through it change ``t``); a non-contiguous tensor is copied."""
    if t.device.type != "cpu":
        raise ValueError(f"byte_view needs a CPU tensor, got one on {t.device}")
    t = t.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    flat = t.reshape(-1)
    if flat.stride(0) != 1:  # a strided view that flattens without a copy (also one of 0 or 1 elements, which
        flat = flat.clone(memory_format=torch.contiguous_format)  # contiguous() would return with its stride)
    return flat.view(torch.uint8).numpy()


def raw_ptr(t: torch.Tensor) -> int | None:
    """``data_ptr()`` of a contiguous CPU tensor whose memory holds its plain values (not a lazily
    conjugated or negated view), else None. The caller keeps ``t`` alive while the pointer is used."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.is_conj() or t.is_neg():
        return None
    return t.data_ptr()


def even_stride(t: torch.Tensor) -> int | None:
    """Bytes between consecutive elements of a CPU tensor in row-major order when that distance is the same
    throughout (its element size for a contiguous tensor; twice that for every other element of one, as the
    bf16 halves of fp32 weights), else None (also for a lazily conjugated or negated view). The elements are
    then at ``data_ptr() + i * even_stride(t)``."""
    if t.device.type != "cpu" or t.is_conj() or t.is_neg():
        return None
    step, span = None, 1
    for size, stride in zip(reversed(t.shape), reversed(t.stride())):
        if size == 1:
            continue
        if step is None:
            step = stride
        elif stride != step * span:
            return None
        span *= size
    return (1 if step is None else step) * t.element_size()


_INT_OF_BITS = {8: torch.uint8, 16: torch.int16, 32: torch.int32, 64: torch.int64}


def int_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` (any device) viewed as integers of its element width: bit-exact compares, gathers and writes."""
    return t.view(_INT_OF_BITS[t.element_size() * 8])


def nbytes_of(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def shape_of(t: torch.Tensor) -> list[int]:
    return [int(s) for s in t.shape]
