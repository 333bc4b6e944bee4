"""MoE routes: bit packing at ``ceil(log2 E)`` bits per expert id, the compact dtype routes are held in, and the
routed gather (combine weights of recorded experts, with autograd). Backends ``reference`` (vectorised PyTorch,
what ``auto`` picks on the CPU; registered by ``syncd/ops/reference/backend.py``) and ``triton``; every backend
gives the same bits."""

from __future__ import annotations

import importlib

import torch

from syncd.ops import _backend
from syncd.ops._dispatch import dispatch, kernel_of, register, resolve
from syncd.ops._replay_layout import bits_per_id

__all__ = ["NO_ROUTE", "route_dtype", "routes_backend", "pack_routes", "unpack_routes", "gather_routed"]

#: the route of a position the engine never routed (padding, the sequence's last token): never an expert id
NO_ROUTE = -1
MAX_EXPERTS = 1 << 16


def route_dtype(num_experts: int) -> torch.dtype:
    """The smallest signed dtype that holds expert ids ``0..num_experts-1`` and :data:`NO_ROUTE`."""
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"num_experts {num_experts} outside 1..{MAX_EXPERTS}")
    return torch.int8 if num_experts <= 127 else torch.int16 if num_experts <= 32767 else torch.int32


def routes_backend(backend: str, device_type: str) -> str:
    """The concrete backend of the route ops (``reference`` or ``triton``); BackendUnavailable with the reason."""
    return resolve("gather_routed", backend, device_type)


def _triton():
    _backend.triton_module()
    return importlib.import_module("syncd.ops.triton_kernels.replay")


def _check_experts(num_experts) -> int:
    if not isinstance(num_experts, int) or not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"num_experts must be an int in 1..{MAX_EXPERTS}, got {num_experts!r}")
    return num_experts


# ---------------------------------------------------------------------------------------------- kernels
# reference (syncd/ops/reference/backend.py): vectorised PyTorch, what ``auto`` picks on the CPU (there is no
# native route kernel); triton on GPUs


register("pack_routes", "triton", lambda ids, E: _triton().pack_routes(ids.to(torch.int64).contiguous(),
                                                                    bits_per_id(E)))


def _unpack_triton(packed, count, E):
    vals = _triton().unpack_routes(packed, count, bits_per_id(E))
    tail = count * bits_per_id(E)
    return vals, tail % 8 == 0 or not int(packed[-1]) >> (tail % 8)


register("unpack_routes", "triton", _unpack_triton)
register("gather_routed", "triton", (lambda probs, routes: _triton().gather_routed(probs, routes),
                                     lambda grad, routes, E: _triton().gather_routed_backward(grad, routes, E)))


def pack_routes(ids: torch.Tensor, num_experts: int, *, backend: str = "auto") -> torch.Tensor:
    """uint8 ``[ceil(n * b / 8)]``: the ``n`` expert ids of ``ids`` (any shape, row-major) as ``b =
    max(1, ceil(log2 num_experts))``-bit fields, LSB first, padding bits 0 (``docs/replay-format.md``).
    Raises ``ValueError`` for a non-integer tensor or an id outside ``[0, num_experts)``."""
    E = _check_experts(num_experts)
    if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError("pack_routes takes an integer tensor of expert ids")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= E):
        raise ValueError(f"pack_routes: expert ids outside 0..{E - 1}")
    return dispatch("pack_routes", backend, ids.device.type)(ids, E)


def unpack_routes(packed: torch.Tensor, count: int, num_experts: int, *, backend: str = "auto") -> torch.Tensor:
    """The ``count`` int64 ids of :func:`pack_routes` bytes (uint8, exactly ``ceil(count * b / 8)`` of them).
    Raises ``ValueError`` for another length, a set padding bit, or an id ``>= num_experts``."""
    E = _check_experts(num_experts)
    b = bits_per_id(E)
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        raise ValueError("unpack_routes takes a uint8 tensor")
    if count < 0 or packed.numel() != (count * b + 7) // 8:
        raise ValueError(f"unpack_routes: {count} ids of {b} bits take {(count * b + 7) // 8} bytes, got "
                         f"{packed.numel()}")
    unpack = dispatch("unpack_routes", backend, packed.device.type)
    vals, clean = unpack(packed.reshape(-1).contiguous(), count, E)
    if not clean:
        raise ValueError("unpack_routes: padding bits after the last id are not zero")
    if vals.numel() and int(vals.max()) >= E:
        raise ValueError(f"unpack_routes: expert id {int(vals.max())} outside 0..{E - 1}")
    return vals


class _GatherRouted(torch.autograd.Function):
    @staticmethod
    def forward(ctx, probs, routes, name):
        ctx.save_for_backward(routes)
        ctx.meta = (name, probs.shape[1])
        return kernel_of("gather_routed", name)[0](probs.detach().contiguous(), routes)

    @staticmethod
    def backward(ctx, grad):
        (routes,) = ctx.saved_tensors
        name, E = ctx.meta
        return kernel_of("gather_routed", name)[1](grad.contiguous(), routes, E), None, None


def gather_routed(probs: torch.Tensor, routes: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """``out[n, j] = probs[n, routes[n, j]]`` (``probs`` ``[N, E]`` floating, ``routes`` ``[N, k]`` integer with
    distinct ids per row, :data:`NO_ROUTE` giving 0), differentiable in ``probs`` (the backward scatters into
    the routed entries only). Raises ``ValueError`` for shapes that do not fit, ids outside ``[-1, E)``, or an
    expert twice in one row."""
    if not isinstance(probs, torch.Tensor) or probs.dim() != 2 or not probs.dtype.is_floating_point:
        raise ValueError("gather_routed: probs must be a [N, E] floating tensor")
    if not isinstance(routes, torch.Tensor) or routes.dim() != 2 or routes.dtype.is_floating_point \
            or routes.shape[0] != probs.shape[0] or routes.device != probs.device:
        raise ValueError(f"gather_routed: routes must be an integer [N, k] tensor on {probs.device} with N = "
                         f"{probs.shape[0]}; got {routes.dtype} {tuple(routes.shape)} on {routes.device}")
    E = probs.shape[1]
    routes = routes.to(torch.int64).contiguous()
    if routes.numel():
        if int(routes.min()) < NO_ROUTE or int(routes.max()) >= E:
            raise ValueError(f"gather_routed: expert ids outside {NO_ROUTE}..{E - 1}")
        s = routes.sort(dim=1).values
        if bool(((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).any()):
            raise ValueError("gather_routed: an expert appears twice in one position's routes")
    return _GatherRouted.apply(probs, routes, routes_backend(backend, probs.device.type))
