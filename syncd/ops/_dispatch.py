"""The one dispatch table of the op surface: every op registers each backend's kernel here once (next to its
plain-PyTorch/NumPy ``reference``), and every call resolves ``backend="auto"|"cpu"|"cuda"|"triton"|"reference"``
through :func:`resolve` / :func:`dispatch`.

``auto`` picks, among the backends an op registered, the first that can run on the tensor's device: on the
CPU ``cpu`` then ``reference``; on a GPU the op's order in :data:`syncd.ops._backend.GPU_PREFERENCE` (measured
by ``bench/gpu_check.sh``), else ``cuda`` then ``triton``. Naming a backend that cannot run raises
:class:`~syncd.errors.BackendUnavailable` with the reason: the device's own (a CPU tensor on ``cuda``, a module
not built), else that the op has no kernel there, else what the kernel itself needs (``requires``).

Registration happens when an op's module is imported; the table is read-only afterwards (thread-safe). The
``reference`` entries are the specification's (``syncd/ops/reference/``), registered by the reference backend
(``syncd/ops/reference/backend.py``) when this module is imported: the table is the only way production code
reaches the specification (``tests/ops/test_spec_boundary.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from syncd.errors import BackendUnavailable
from syncd.ops import _backend

__all__ = ["register", "kernel", "resolve", "dispatch", "backends_of", "kernel_of"]


@dataclass(frozen=True)
class _Kernel:
    fn: Callable
    requires: Callable[[], str | None] | None = None  # None when the kernel can run, else why not


_TABLE: dict[str, dict[str, _Kernel]] = {}


def _kernels(op: str) -> dict[str, _Kernel]:
    """``op``'s kernels; ValueError naming the registered ops for an unknown one (a typo, or an op whose module
    was not imported)."""
    kernels = _TABLE.get(op)
    if kernels is None:
        raise ValueError(f"unknown op {op!r}; registered: {', '.join(sorted(_TABLE)) or 'none'} (an op registers "
                         "when its syncd.ops module is imported)")
    return kernels


def register(op: str, backend: str, fn: Callable, *, requires: Callable[[], str | None] | None = None) -> Callable:
    """Register ``fn`` as ``op``'s kernel on ``backend`` (once: a second registration is a programming error).
    ``requires()`` says why the kernel cannot run although its backend can (e.g. a native module that predates
    it), or None."""
    if backend not in _backend.BACKENDS or backend == "auto":
        raise ValueError(f"cannot register {op!r} for backend {backend!r}")
    kernels = _TABLE.setdefault(op, {})
    if backend in kernels:
        raise ValueError(f"{op!r} already has a {backend} kernel")
    kernels[backend] = _Kernel(fn, requires)
    return fn


def kernel(op: str, *backends: str, requires=None):
    """Decorator form of :func:`register` for one or more backends (the same function on each)."""
    def deco(fn):
        for b in backends:
            register(op, b, fn, requires=requires)
        return fn
    return deco


def backends_of(op: str) -> tuple[str, ...]:
    """The backends ``op`` has kernels for (ValueError for an unknown op)."""
    return tuple(_kernels(op))


def resolve(op: str, backend: str, device_type: str) -> str:
    """The concrete backend that runs ``op`` for ``backend`` on ``device_type``; raises
    :class:`BackendUnavailable` saying why none can (see the module docstring), ValueError for an unknown op."""
    if backend not in _backend.BACKENDS:
        raise BackendUnavailable(f"unknown backend {backend!r}; expected one of {', '.join(_backend.BACKENDS)}")
    kernels = _kernels(op)
    if backend != "auto":
        _backend.check(backend, device_type)  # the device's own reason first
        k = kernels.get(backend)
        if k is None:
            raise BackendUnavailable(f"{op} has no {backend} kernel (its backends: {', '.join(kernels)})")
        why = k.requires() if k.requires is not None else None
        if why:
            raise BackendUnavailable(why)
        return backend
    order = ("cpu", "reference") if device_type == "cpu" else _backend.GPU_PREFERENCE.get(op, ("cuda", "triton"))
    reasons = []
    for name in order:
        k = kernels.get(name)
        if k is None:
            continue
        why = _backend.available(name, device_type) or (k.requires() if k.requires is not None else None)
        if why is None:
            return name
        reasons.append(f"{name}: {why}")
    why = "; ".join(reasons) or f"it has kernels for {', '.join(kernels)} only"
    raise BackendUnavailable(f"no backend of {op} can run on {device_type}: {why}")


def dispatch(op: str, backend: str, device_type: str) -> Callable:
    """The kernel that runs ``op`` for ``backend`` on ``device_type`` (:func:`resolve`)."""
    return _kernels(op)[resolve(op, backend, device_type)].fn


def kernel_of(op: str, name: str) -> Callable:
    """The kernel of ``op`` on the concrete backend ``name`` (one :func:`resolve` returned); ValueError for an
    unknown op or a backend it has no kernel for."""
    kernels = _kernels(op)
    if name not in kernels:
        raise ValueError(f"{op} has no {name} kernel (its backends: {', '.join(kernels)})")
    return kernels[name].fn


# Last, once register() exists: the reference backend registers every op's ``reference`` entry.
from syncd.ops.reference import backend as _reference_backend  # noqa: E402,F401
