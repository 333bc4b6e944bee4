"""NVFP4 quantization-aware training that matches the engines bit for bit.

The forward pass of every wrapped linear layer uses ``dequantize(quantize(W.to(dtype)), dtype)``: exactly the
weights an engine serves from the NVFP4 tensors this trainer publishes (:func:`export_nvfp4`), because both
sides run one quantizer (:mod:`syncd.ops.nvfp4`, every backend bit-identical). The gradient is
straight-through: d loss / d W = d loss / d W_fake_quant, unchanged. Usage::

    names = enable_qat(model)                    # wraps nn.Linear weights (not the LM head)
    for step in range(n):
        loss = model(**batch).loss; loss.backward(); opt.step(); opt.zero_grad()
        pub.publish(export_nvfp4(model), step)   # WeightPublisher(..., dtype=None)

The master weights stay as they are (float32 usually); only the forward sees the quantized copy. The
per-tensor scale is recomputed from the weight at every forward (``amax / 2688``), as the export does.
"""

from __future__ import annotations

import logging
import types
from typing import Iterable

import torch
import torch.nn.functional as F

from syncd.ops import nvfp4

log = logging.getLogger(__name__)

_ATTR = "_syncd_nvfp4_qat"


class _FakeQuant(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w: torch.Tensor, dtype: torch.dtype, backend: str) -> torch.Tensor:
        q = nvfp4.quantize(w.detach().to(dtype), backend=backend)
        return nvfp4.dequantize(q, dtype, backend=backend).to(w.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None, None


def fake_quant(w: torch.Tensor, *, dtype: torch.dtype = torch.bfloat16, backend: str = "auto") -> torch.Tensor:
    """NVFP4 fake quantization with a straight-through gradient: ``w`` cast to ``dtype`` (the serving dtype),
    quantized, dequantized to ``dtype`` and returned in ``w``'s dtype (exact: the values are ``dtype``
    values). Differentiable in ``w`` (identity gradient). Raises like :func:`syncd.ops.nvfp4.quantize`."""
    return _FakeQuant.apply(w, dtype, backend)


def _qat_forward(self, input: torch.Tensor) -> torch.Tensor:
    cfg = getattr(self, _ATTR)
    return F.linear(input, fake_quant(self.weight, dtype=cfg["dtype"], backend=cfg["backend"]), self.bias)


def _default_exclude(name: str) -> bool:
    return "lm_head" in name


def enable_qat(model: torch.nn.Module, *, exclude=_default_exclude, dtype: torch.dtype = torch.bfloat16,
               backend: str = "auto") -> list[str]:
    """Make every ``nn.Linear`` of ``model`` (but those ``exclude(module_name)`` picks: the LM head by default,
    and those whose input dimension is not a multiple of 16) run its forward on NVFP4 fake-quantized weights.

    Parameters, their names and the state dict are unchanged. Returns the state-dict names of the wrapped
    weights (what :func:`export_nvfp4` quantizes). Idempotent; :func:`disable_qat` undoes it."""
    names = []
    for mname, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear) or exclude(mname):
            continue
        if mod.in_features % nvfp4.BLOCK:
            log.info("QAT: %s left unquantized (in_features %d is not a multiple of 16)", mname, mod.in_features)
            continue
        setattr(mod, _ATTR, {"dtype": dtype, "backend": backend})
        mod.forward = types.MethodType(_qat_forward, mod)
        names.append(f"{mname}.weight" if mname else "weight")
    return names


def disable_qat(model: torch.nn.Module) -> None:
    """Restore the plain forward of every layer :func:`enable_qat` wrapped."""
    for mod in model.modules():
        if hasattr(mod, _ATTR):
            delattr(mod, _ATTR)
            del mod.forward  # back to the class's forward


def qat_weight_names(model: torch.nn.Module) -> list[str]:
    """State-dict names of the weights whose forward is fake-quantized now."""
    return [f"{m}.weight" if m else "weight" for m, mod in model.named_modules() if hasattr(mod, _ATTR)]


def export_nvfp4(model: torch.nn.Module, *, names: Iterable[str] | None = None, dtype: torch.dtype = torch.bfloat16,
                 backend: str = "auto") -> dict:
    """The state dict to publish for NVFP4 serving: the QAT-wrapped weights (or ``names``; if QAT is off
    and no names are given, :func:`syncd.ops.nvfp4.is_linear_weight` picks them) as NVFP4 parts
    (``<name>.qdata``, ``.scales``, ``.per_tensor_scale``; see ``docs/nvfp4.md``), every other floating-point
    tensor cast to ``dtype``. The NVFP4 values equal the QAT forward's weights bit for bit.

    Publish it with ``WeightPublisher(..., dtype=None)``: the publisher's default cast to bfloat16 would
    round the float32 per-tensor scales (``syncd.ops.nvfp4.load_state_dict`` refuses such a state)."""
    if names is None:
        wrapped = qat_weight_names(model)
        names = wrapped if wrapped else None
    return nvfp4.quantize_state_dict(model.state_dict(), names, dtype=dtype, backend=backend)
