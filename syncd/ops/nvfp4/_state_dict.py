"""NVFP4 state dicts: how a model's quantized weights are named when they are published, and how an engine
reads them back.

A weight ``<name>`` [..., K] quantized to NVFP4 becomes three plain tensors, in this order, where the
weight was::

    <name>.qdata             uint8 [..., K/2]              packed E2M1 codes (element 2j in the low nibble)
    <name>.scales            float8_e4m3fn [..., K/16]     block scales, linear layout
    <name>.per_tensor_scale  float32 []                    decode convention (value = code * scale * pts)

Every other tensor is kept (floating-point ones cast to the serving dtype). These are ordinary tensors, so
``syncd.trainer.WeightPublisher`` ships them as deltas of the packed bytes like any other (publish with
``dtype=None`` so that the float32 per-tensor scales are not cast) and ``syncd.materialize`` returns them
bit for bit. See ``docs/nvfp4.md``.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping

import torch

from syncd.ops.nvfp4._quant import dequantize, quantize
from syncd.ops.nvfp4._tensor import NVFP4Tensor

QDATA, SCALES, PER_TENSOR_SCALE = ".qdata", ".scales", ".per_tensor_scale"
SUFFIXES = (QDATA, SCALES, PER_TENSOR_SCALE)
_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _selected(state: Mapping[str, torch.Tensor], names) -> list[str]:
    if names is None:
        return [n for n, t in state.items() if is_linear_weight(n, t)]
    if callable(names):
        return [n for n, t in state.items() if names(n, t)]
    names = list(names)
    missing = [n for n in names if n not in state]
    if missing:
        raise KeyError(f"not in the state dict: {missing[:5]}")
    return names


def is_linear_weight(name: str, t: torch.Tensor) -> bool:
    """The default choice of weights to quantize: 2-d floating-point ``*.weight`` tensors whose last dimension
    is a multiple of 16, except embeddings and the LM head (names containing ``embed`` or ``lm_head``)."""
    return (name.endswith(".weight") and t.dim() == 2 and t.is_floating_point() and t.shape[-1] % 16 == 0
            and "embed" not in name and "lm_head" not in name)


def quantize_state_dict(state: Mapping[str, torch.Tensor], names: Iterable[str] | Callable | None = None, *,
                        dtype: torch.dtype | None = torch.bfloat16, backend: str = "auto") -> dict:
    """``state`` with the chosen weights replaced by their NVFP4 parts (``<name>.qdata``, ``.scales``,
    ``.per_tensor_scale``, in place of the weight, names order kept).

    ``names``: the weights to quantize: an iterable of names, a predicate ``(name, tensor) -> bool``, or
    None for :func:`is_linear_weight`. ``dtype``: every chosen weight is cast to it before quantizing (the
    serving copy the engine would otherwise get; None quantizes the tensor as it is), and every other
    floating-point tensor is cast to it (None keeps it). Raises ``KeyError`` for a named weight that is not
    there, ``ValueError`` for one that cannot be quantized (see :func:`syncd.ops.nvfp4.quantize`) or whose
    derived names are already taken."""
    chosen = set(_selected(state, names))
    out: dict = {}
    for name, t in state.items():
        t = t.detach()
        if name in chosen:
            for suffix in SUFFIXES:
                if name + suffix in state:
                    raise ValueError(f"cannot quantize {name!r}: {name + suffix!r} is already in the state dict")
            try:
                q = quantize(t.to(dtype) if dtype is not None else t, backend=backend)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from e
            out[name + QDATA], out[name + SCALES], out[name + PER_TENSOR_SCALE] = q.qdata, q.scales, q.per_tensor_scale
        else:
            out[name] = t.to(dtype) if dtype is not None and t.dtype in _FLOATS else t
    return out


def nvfp4_names(state: Mapping[str, torch.Tensor]) -> list[str]:
    """Names of the weights stored as NVFP4 parts in ``state`` (those with a ``.qdata`` entry), in order."""
    return [n[: -len(QDATA)] for n in state if n.endswith(QDATA)]


def load_state_dict(state: Mapping[str, torch.Tensor]) -> dict:
    """``state`` with each NVFP4 triple gathered into one :class:`NVFP4Tensor` under the weight's name (at
    the place of its ``.qdata`` entry); other tensors are passed through. What an engine that serves NVFP4
    weights (dequantizing on the fly or with its own kernels) loads.

    Raises ``ValueError`` for an incomplete triple or parts of the wrong dtype or shape (a per-tensor scale
    that was cast to bfloat16 by a publisher with ``dtype`` set is refused, not silently used)."""
    out: dict = {}
    names = set(nvfp4_names(state))
    parts = {n + s for n in names for s in SUFFIXES}
    for key, t in state.items():
        if key.endswith(QDATA) and key[: -len(QDATA)] in names:
            name = key[: -len(QDATA)]
            missing = [name + s for s in SUFFIXES if name + s not in state]
            if missing:
                raise ValueError(f"NVFP4 weight {name!r} is incomplete: missing {missing}")
            try:
                out[name] = NVFP4Tensor(t, state[name + SCALES], state[name + PER_TENSOR_SCALE])
            except ValueError as e:
                raise ValueError(f"NVFP4 weight {name!r}: {e}") from e
        elif key in parts:
            continue
        else:
            if key.endswith((SCALES, PER_TENSOR_SCALE)):
                raise ValueError(f"{key!r} looks like an NVFP4 part but its weight has no {QDATA} entry")
            out[key] = t
    return out


def dequantize_state_dict(state: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16, *,
                          backend: str = "auto") -> dict:
    """A plain state dict: every NVFP4 weight in ``state`` dequantized to ``dtype`` under its own name,
    other tensors passed through. Loading it into the model serves exactly the weights the trainer's QAT
    forward used. Raises like :func:`load_state_dict`."""
    return {n: dequantize(t, dtype, backend=backend) if isinstance(t, NVFP4Tensor) else t
            for n, t in load_state_dict(state).items()}
