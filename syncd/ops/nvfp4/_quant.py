"""``quantize`` / ``dequantize`` / ``per_tensor_scale`` with backend dispatch. The arithmetic is specified by
``syncd/ops/reference/nvfp4.py`` (the ``reference`` backend, registered by ``syncd/ops/reference/backend.py``);
every backend writes the same bits."""

from __future__ import annotations

import functools
import importlib
import math

import torch

from syncd.ops import _backend
from syncd.ops._dispatch import dispatch, kernel, kernel_of, register, resolve
from syncd.ops._nvfp4_format import AMAX_PER_SCALE, INPUT_DTYPES, OUTPUT_DTYPES, PTS_MAX, PTS_MIN
from syncd.ops._tensors import raw_ptr
from syncd.ops.nvfp4._tensor import BLOCK, NVFP4Tensor

_CODE = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}
_NONFINITE = "NVFP4 quantize: the input holds NaN or infinite values, which NVFP4 cannot represent"


def _check_input(x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"NVFP4 quantize takes a torch.Tensor, not {type(x).__name__}")
    if x.dtype not in INPUT_DTYPES:
        raise ValueError(f"NVFP4 quantize takes bfloat16, float16 or float32 tensors, not {x.dtype}")
    if x.dim() < 1 or x.shape[-1] % BLOCK:
        raise ValueError(f"NVFP4 quantize needs a last dimension that is a multiple of {BLOCK}; got shape "
                         f"{tuple(x.shape)}")


def _gpu_kernels(name: str):
    if name == "triton":
        _backend.triton_module()
        return importlib.import_module("syncd.ops.triton_kernels.nvfp4")
    _backend.cuda_native()
    return importlib.import_module("syncd.ops.nvfp4._cuda")


def _from_amax(amax: torch.Tensor) -> torch.Tensor:
    return torch.clamp(amax.float().reshape(()) / AMAX_PER_SCALE, PTS_MIN, PTS_MAX)


# ---------------------------------------------------------------------------------------------- kernels
# Each op's kernels by backend (syncd.ops._dispatch; the reference ones: syncd/ops/reference/backend.py). The
# per-tensor scale runs on the backend quantize picked.


@kernel("nvfp4_scale", "cpu")
def _scale_cpu(x: torch.Tensor) -> torch.Tensor:
    xc = x.detach().contiguous()
    amax, bad = _backend.native().nvfp4_amax(raw_ptr(xc), xc.numel(), _CODE[x.dtype], _backend.threads())
    if bad:
        raise ValueError(_NONFINITE)
    return _from_amax(torch.tensor(amax, dtype=torch.float32))


@kernel("nvfp4_scale", "cuda", "triton")
def _scale_gpu(x: torch.Tensor) -> torch.Tensor:
    if not x.numel():
        return _from_amax(torch.zeros((), dtype=torch.float32, device=x.device))
    # GPU: one fused reduction on the device, no host sync (NaN/Inf are caught by the quantize kernel)
    return _from_amax(torch.linalg.vector_norm(x.detach(), float("inf"), dtype=torch.float32))


def _quantize_into(name: str, x: torch.Tensor, pts: torch.Tensor):
    xc = x.detach().contiguous()
    k = x.shape[-1]
    lead = tuple(x.shape[:-1])
    qdata = torch.empty((*lead, k // 2), dtype=torch.uint8, device=x.device)
    scales = torch.empty((*lead, k // BLOCK), dtype=torch.float8_e4m3fn, device=x.device)
    if name == "cpu":
        bad = _backend.native().nvfp4_quantize(raw_ptr(xc), xc.numel() // BLOCK, _CODE[x.dtype], float(pts),
                                               qdata.data_ptr(), scales.data_ptr(), _backend.threads())
    else:
        bad = _gpu_kernels(name).quantize(xc, pts, qdata, scales.view(torch.uint8))
    if bad:
        raise ValueError(_NONFINITE)
    return qdata, scales


def _dequantize_into(name: str, q: NVFP4Tensor, dtype: torch.dtype, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        out = torch.empty(q.shape, dtype=dtype, device=q.device)
    qdata, scales = q.qdata.contiguous(), q.scales.contiguous().view(torch.uint8)
    if name == "cpu":
        _backend.native().nvfp4_dequantize(qdata.data_ptr(), scales.data_ptr(), out.numel() // BLOCK,
                                           float(q.per_tensor_scale), out.data_ptr(), _CODE[dtype],
                                           _backend.threads())
    else:
        _gpu_kernels(name).dequantize(qdata, scales, q.per_tensor_scale.contiguous(), out)
    return out


for _name in ("cpu", "cuda", "triton"):
    register("nvfp4_quantize", _name, functools.partial(_quantize_into, _name))
    register("nvfp4_dequantize", _name, functools.partial(_dequantize_into, _name))


# ---------------------------------------------------------------------------------------------- ops


def per_tensor_scale(x: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """The per-tensor scale :func:`quantize` computes for ``x``: float32 0-dim tensor on ``x``'s device,
    ``clamp(max|x| / (448 * 6), 2**-100, 2**100)`` (decode convention).

    Raises ``ValueError`` for NaN/Inf (on the CPU backends; GPU backends report them from ``quantize``),
    ``ValueError``/``TypeError`` for inputs ``quantize`` rejects, ``BackendUnavailable``."""
    _check_input(x)
    return kernel_of("nvfp4_scale", resolve("nvfp4_quantize", backend, x.device.type))(x)


def _given_scale(pts, device: torch.device) -> torch.Tensor:
    t = torch.as_tensor(pts, dtype=torch.float32).detach()
    if t.numel() != 1:
        raise ValueError(f"per_tensor_scale must be one value, got shape {tuple(t.shape)}")
    t = t.reshape(()).to(device)
    v = float(t)
    if not (math.isfinite(v) and PTS_MIN <= v <= PTS_MAX):
        raise ValueError(f"per_tensor_scale must be a finite float32 in [2**-100, 2**100] (decode convention, "
                         f"amax / 2688); got {v!r}")
    return t


def quantize(x: torch.Tensor, *, per_tensor_scale=None, swizzle: bool = False,
             backend: str = "auto") -> NVFP4Tensor:
    """Quantize ``x`` [..., K] (bfloat16, float16 or float32; K a multiple of 16) to NVFP4.

    ``per_tensor_scale``: float32 decode-convention scale (a float or one-element tensor in
    [2**-100, 2**100]); None computes it from ``x`` (:func:`per_tensor_scale`). A scale smaller than
    ``max|x| / 2688`` (a calibrated one) saturates block scales at 448 and codes at +-6. ``swizzle``: return
    the block scales in the 128x4 swizzled layout instead of linear. The result lives on ``x``'s device; every
    backend returns the same bits (FlashInfer/vLLM recipe, ``docs/nvfp4.md``).

    Raises ``ValueError`` for NaN/Inf in ``x``, a bad shape, dtype or scale; ``TypeError`` for a non-tensor;
    ``BackendUnavailable`` when the named backend cannot run on ``x``'s device."""
    _check_input(x)
    name = resolve("nvfp4_quantize", backend, x.device.type)
    pts = (kernel_of("nvfp4_scale", name)(x) if per_tensor_scale is None
           else _given_scale(per_tensor_scale, x.device))
    qdata, scales = kernel_of("nvfp4_quantize", name)(x, pts)
    q = NVFP4Tensor(qdata, scales, pts)
    return q.to_swizzled() if swizzle else q


def dequantize(q: NVFP4Tensor, dtype: torch.dtype = torch.bfloat16, *, out: torch.Tensor | None = None,
               backend: str = "auto") -> torch.Tensor:
    """The values of ``q`` as a ``dtype`` tensor (bfloat16, float16 or float32) of shape ``q.shape`` on
    ``q``'s device: ``e2m1(code) * (float(scale) * per_tensor_scale)`` in float32, rounded to nearest even.

    ``out``: a contiguous tensor of that shape, dtype and device to write into (an engine's parameter, say),
    returned. Raises ``TypeError`` for a non-NVFP4Tensor, ``ValueError`` for another dtype or an ``out`` that
    does not fit, ``BackendUnavailable``."""
    if not isinstance(q, NVFP4Tensor):
        raise TypeError(f"dequantize takes an NVFP4Tensor, not {type(q).__name__}")
    if dtype not in OUTPUT_DTYPES:
        raise ValueError(f"NVFP4 dequantize produces bfloat16, float16 or float32, not {dtype}")
    if out is not None and (out.shape != q.shape or out.dtype != dtype or out.device != q.device
                            or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous {dtype} tensor of shape {tuple(q.shape)} on {q.device}; got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}{'' if out.is_contiguous() else ', strided'}")
    q = q.to_linear()
    return dispatch("nvfp4_dequantize", backend, q.device.type)(q, dtype, out)


__all__ = ["dequantize", "per_tensor_scale", "quantize"]
