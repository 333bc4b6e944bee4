"""``kept_logprobs``: log-probabilities renormalised over the kept set the sampler drew from, with backend dispatch
and autograd. The arithmetic is specified by ``syncd/ops/reference/replay.py`` (the ``reference`` backend, registered
by ``syncd/ops/reference/backend.py``)."""

from __future__ import annotations

import functools
import importlib
import math

import torch

from syncd.ops import _backend
from syncd.ops._dispatch import kernel_of, register, resolve
from syncd.ops._replay_layout import kept_rows

__all__ = ["kept_logprobs", "check_kept", "check_csr", "kept_backend"]

_CODE = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}
_INT = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _native_kept() -> str | None:
    if not hasattr(_backend.native(), "kept_forward"):
        return "the native module syncd._native predates kept_logprobs; rebuild it (bash scripts/setup.sh)"
    return None


def kept_backend(backend: str, device_type: str) -> str:
    """The concrete backend of ``kept_logprobs`` for ``backend`` on ``device_type`` (BackendUnavailable)."""
    return resolve("kept_logprobs", backend, device_type)


def _ints(x, what: str, device) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        x = torch.as_tensor(x)
    if x.dtype not in _INT or x.dim() != 1:
        raise ValueError(f"kept_logprobs: {what} must be a 1-d integer tensor, got {x.dtype} of shape {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"kept_logprobs: {what} is on {x.device}, the logits on {device}")
    return x.to(torch.int64).contiguous()


def check_kept(logits: torch.Tensor, ids, offsets, targets, temperature: float):
    """Validate the inputs of :func:`kept_logprobs`; returns ``(ids, offsets, targets)`` as contiguous int64.
    Raises ``TypeError``/``ValueError`` saying what is wrong (the target-in-kept-set check is the backends')."""
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"kept_logprobs takes a torch.Tensor of logits, not {type(logits).__name__}")
    if logits.dim() != 2 or logits.dtype not in _CODE:
        raise ValueError(f"kept_logprobs: logits must be [T, V] float32, bfloat16 or float16; got {logits.dtype} "
                         f"of shape {tuple(logits.shape)}")
    return check_csr(logits.shape[0], logits.shape[1], logits.device, ids, offsets, targets, temperature)


def check_csr(T: int, V: int, dev, ids, offsets, targets, temperature: float):
    """The checks of :func:`check_kept` for ``T`` rows over a vocabulary of ``V`` on device ``dev``."""
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"kept_logprobs: temperature must be a finite number > 0, got {temperature!r}")
    ids, offsets, targets = _ints(ids, "ids", dev), _ints(offsets, "offsets", dev), _ints(targets, "targets", dev)
    if offsets.numel() != T + 1 or targets.numel() != T:
        raise ValueError(f"kept_logprobs: {T} rows need {T + 1} offsets and {T} targets; got {offsets.numel()} "
                         f"and {targets.numel()}")
    if int(offsets[0]) != 0 or int(offsets[-1]) != ids.numel():
        raise ValueError(f"kept_logprobs: offsets must run from 0 to len(ids) = {ids.numel()}; got "
                         f"{int(offsets[0])}..{int(offsets[-1])}")
    sizes = offsets[1:] - offsets[:-1]
    if T and int(sizes.min()) < 1:
        row = int(torch.nonzero(sizes < 1)[0])
        raise ValueError(f"kept_logprobs: row {row} has {int(sizes[row])} kept ids (a kept set holds at least one)")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= V):
        raise ValueError(f"kept_logprobs: kept ids outside 0..{V - 1}")
    if T and (int(targets.min()) < 0 or int(targets.max()) >= V):
        raise ValueError(f"kept_logprobs: targets outside 0..{V - 1}")
    if ids.numel() > 1:
        step = ids[1:] - ids[:-1]
        first = torch.zeros(ids.numel(), dtype=torch.bool, device=dev)
        first[offsets[:-1].clamp(max=max(ids.numel() - 1, 0))] = True
        bad = (step <= 0) & ~first[1:]
        if bool(bad.any()):
            j = int(torch.nonzero(bad)[0]) + 1
            row = int(torch.searchsorted(offsets, torch.tensor([j], device=dev), right=True)[0]) - 1
            raise ValueError(f"kept_logprobs: the kept ids of row {row} are not strictly ascending")
    return ids, offsets, targets


def _triton():
    _backend.triton_module()
    return importlib.import_module("syncd.ops.triton_kernels.replay")


# ---------------------------------------------------------------------------------------------- kernels
# kept_logprobs: forward ``(logprob, lse, zk, bad row or -1)`` and backward (dense gradient) by backend.


def _first_missing(found: torch.Tensor) -> int:
    return int(torch.nonzero(found == 0)[0]) if bool((found == 0).any()) else -1


def _forward_cpu(logits, ids, offsets, targets, temperature):
    T = logits.shape[0]
    out = torch.empty(T, dtype=torch.float32)
    lse = torch.empty(T, dtype=torch.float32)
    zk = torch.empty(ids.numel(), dtype=torch.float32)
    bad = _backend.native().kept_forward(logits.data_ptr(), _CODE[logits.dtype], T, logits.stride(0),
                                         ids.data_ptr(), offsets.data_ptr(), targets.data_ptr(),
                                         float(temperature), out.data_ptr(), lse.data_ptr(), zk.data_ptr(),
                                         _backend.threads())
    return out, lse, zk, bad


def _forward_triton(logits, ids, offsets, targets, temperature):
    out, lse, zk, found = _triton().kept_forward(logits, ids, offsets, targets, temperature)
    return out, lse, zk, _first_missing(found)


def _backward_cpu(grad, zk, ids, offsets, targets, lse, temperature, shape, dtype):
    out = torch.empty(tuple(shape), dtype=dtype)
    _backend.native().kept_backward(grad.data_ptr(), zk.data_ptr(), shape[0], shape[1], ids.data_ptr(),
                                    offsets.data_ptr(), targets.data_ptr(), lse.data_ptr(), float(temperature),
                                    out.data_ptr(), _CODE[dtype], _backend.threads())
    return out


register("kept_logprobs", "cpu", (_forward_cpu, _backward_cpu), requires=_native_kept)
register("kept_logprobs", "triton", (_forward_triton, lambda *a: _triton().kept_backward(*a)))


def _forward(name: str, logits, ids, offsets, targets, temperature):
    """``(logprob, lse, zk)``; raises ValueError for a target outside its kept set."""
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out, lse, zk, bad = kernel_of("kept_logprobs", name)[0](logits, ids, offsets, targets, temperature)
    if bad >= 0:
        raise ValueError(f"kept_logprobs: the target {int(targets[bad])} of row {bad} is not in its kept set")
    return out, lse, zk


def _sparse_backward(grad, zk, ids, offsets, targets, lse, temperature, shape, dtype) -> torch.Tensor:
    """The gradient as a coalesced sparse COO tensor: its entries are the kept ones (row-major, already sorted)."""
    rows = kept_rows(offsets)
    hit = (ids == targets[rows]).float()
    vals = grad.detach().float()[rows] * (hit - torch.exp(zk - lse[rows])) / temperature
    return torch.sparse_coo_tensor(torch.stack([rows, ids]), vals.to(dtype), tuple(shape), is_coalesced=True,
                                   check_invariants=False)


def _backward(name: str, grad, zk, ids, offsets, targets, lse, temperature, shape, dtype):
    grad = grad.detach().float().contiguous()
    return kernel_of("kept_logprobs", name)[1](grad, zk, ids, offsets, targets, lse, temperature, shape, dtype)


class _KeptLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, ids, offsets, targets, temperature, name, sparse_grad):
        out, lse, zk = _forward(name, logits.detach(), ids, offsets, targets, temperature)
        ctx.save_for_backward(zk, ids, offsets, targets, lse)  # not the logits: they may be freed
        ctx.meta = (name, float(temperature), tuple(logits.shape), logits.dtype, sparse_grad)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad, _grad_lse):
        zk, ids, offsets, targets, lse = ctx.saved_tensors
        name, temperature, shape, dtype, sparse_grad = ctx.meta
        if grad is None:
            return (None,) * 7
        backward = _sparse_backward if sparse_grad else functools.partial(_backward, name)
        return (backward(grad, zk, ids, offsets, targets, lse, temperature, shape, dtype),) + (None,) * 6


def kept_logprobs(logits: torch.Tensor, ids, offsets, targets, temperature: float = 1.0, *,
                  backend: str = "auto", return_lse: bool = False, sparse_grad: bool = False):
    """Log-probabilities of ``targets`` under the distributions the sampler drew from: for row ``t``,
    ``z[a] - logsumexp(z[kept])`` with ``z = logits[t] / temperature`` in float32, ``kept = ids[offsets[t]:
    offsets[t+1]]`` (CSR: ``offsets`` int ``[T + 1]`` from 0 to ``len(ids)``; each row's ids ascending and
    distinct, at least one, each in ``[0, V)``; the record's order) and ``a = targets[t]``, which must be one
    of them.

    ``logits`` ``[T, V]``: float32, bfloat16 or float16 (rows may be strided, columns contiguous). Returns float32
    ``[T]`` (and the float32 row ``logsumexp`` over the kept set with ``return_lse``, not differentiable).
    Differentiable in ``logits``: the gradient is ``g * (onehot(a) - softmax over the kept ids) / temperature`` at
    the kept entries and 0 elsewhere, in ``logits``' dtype. Nothing of size ``[T, V]`` is built but that
    gradient; only the kept entries are read, and they are saved for the backward (not the logits).

    ``sparse_grad=True``: the gradient is a sparse COO tensor of the kept entries, so nothing of size ``[T, V]``
    is built in the backward either. PyTorch's autograd passes it to a ``torch.nn.functional.linear`` that made the
    logits (an lm_head on ``[T, H]`` hidden states), whose backward then costs ``O(kept * H)`` and returns dense
    gradients; view-like ops between them (``reshape``, indexing) refuse a sparse gradient with an error.

    Raises ``ValueError`` for malformed inputs (naming the row: an empty kept set, ids out of range or not
    ascending, a target outside its kept set), ``TypeError`` for a non-tensor, ``BackendUnavailable``."""
    ids, offsets, targets = check_kept(logits, ids, offsets, targets, temperature)
    name = kept_backend(backend, logits.device.type)
    out, lse = _KeptLogprobs.apply(logits, ids, offsets, targets, float(temperature), name, bool(sparse_grad))
    return (out, lse) if return_lse else out
