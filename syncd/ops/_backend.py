"""Backends of every op: ``backend="auto"|"cpu"|"cuda"|"triton"|"reference"``: whether each can run on a
device (:func:`check`, :func:`available`), the native and GPU modules, and the GPU order ``auto`` follows
(:data:`GPU_PREFERENCE`). Which op runs where is the dispatch table's (:mod:`syncd.ops._dispatch`). Naming a
backend that cannot run raises :class:`syncd.errors.BackendUnavailable` with the reason. Thread-safe (module
state is set once).
"""

from __future__ import annotations

import functools
import importlib
import importlib.machinery
import importlib.util
import logging
import os

from syncd.errors import BackendUnavailable

log = logging.getLogger(__name__)

BACKENDS = ("auto", "cpu", "cuda", "triton", "reference")
#: order tried by ``auto`` for tensors on a CUDA device, per op, from bench/gpu_check.sh on an H200: the
#: CUDA checksum reads at 84-88% of the device copy rate against Triton's 76-82%, Triton's changed-word scan
#: is twice the CUDA one (about 1 TB/s), and end-to-end apply is level (0.9-1.3x) with CUDA slightly ahead.
GPU_PREFERENCE = {
    "checksum": ("cuda", "triton"),
    "encode": ("triton", "cuda"),
    "apply": ("cuda", "triton"),
    # NVFP4 (syncd.ops.nvfp4): not yet timed on a GPU; bench/gpu_nvfp4.py (in bench/gpu_check.sh) times CUDA
    # (one thread per block of 16, 16-byte loads) and Triton (128 blocks per program) side by side.
    "nvfp4_quantize": ("cuda", "triton"),
    "nvfp4_dequantize": ("cuda", "triton"),
    # replay ops (syncd.ops.replay): Triton is their only GPU backend
    "kept_logprobs": ("triton",),
    "routes": ("triton",),
}


@functools.cache
def native():
    """The native CPU module ``syncd._native``; raises BackendUnavailable when it was not built.

    ``SYNCD_NATIVE_DIR`` loads it from another folder instead (used to test an AddressSanitizer build).
    """
    override = os.environ.get("SYNCD_NATIVE_DIR")
    try:
        if override:
            finder = importlib.machinery.PathFinder.find_spec("_native", [override])
            if finder is None:
                raise ImportError(f"no _native module in SYNCD_NATIVE_DIR={override}")
            module = importlib.util.module_from_spec(finder)
            finder.loader.exec_module(module)
            return module
        return importlib.import_module("syncd._native")
    except ImportError as e:
        raise BackendUnavailable(f"the native CPU module syncd._native is not available ({e}); "
                                 "reinstall syncd with a C++17 compiler") from e


@functools.cache
def cuda_native():
    """The CUDA module ``syncd._cuda_native``; raises BackendUnavailable with the reason."""
    import torch

    if not torch.cuda.is_available():
        raise BackendUnavailable("the cuda backend needs a CUDA GPU; torch.cuda.is_available() is False")
    try:
        return importlib.import_module("syncd._cuda_native")
    except ImportError as e:
        raise BackendUnavailable(f"the CUDA module syncd._cuda_native was not built or does not load ({e}); "
                                 "build with nvcc on PATH and SYNCD_CUDA=on") from e


def gpu_kernels(name: str):
    """The kernel module of a GPU backend (``"triton"`` or ``"cuda"``): both expose ``checksum``,
    ``find_changes`` and ``scatter_apply`` with the same contracts."""
    if name == "triton":
        return triton_module()
    cuda_native()
    return importlib.import_module("syncd.ops._cuda")


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def triton_module():
    try:
        import triton  # noqa: F401
    except ImportError as e:
        raise BackendUnavailable(f"the triton backend needs the triton package ({e})") from e
    return importlib.import_module("syncd.ops.triton_kernels")


def available(name: str, device_type: str) -> str | None:
    """None when backend ``name`` can run on ``device_type``, else the reason it cannot."""
    try:
        check(name, device_type)
    except BackendUnavailable as e:
        return str(e)
    return None


def check(name: str, device_type: str) -> None:
    if name == "reference":
        return
    if name == "cpu":
        if device_type != "cpu":
            raise BackendUnavailable(f"the cpu backend works on CPU tensors; this tensor is on {device_type}")
        native()
        return
    if name == "cuda":
        if device_type != "cuda":
            raise BackendUnavailable(f"the cuda backend works on CUDA tensors; this tensor is on {device_type}")
        cuda_native()
        return
    if name == "triton":
        triton_module()
        if device_type == "cuda":
            return
        if device_type == "cpu" and triton_interpreted():
            return
        raise BackendUnavailable(
            f"the triton backend runs on CUDA tensors (or on CPU tensors under TRITON_INTERPRET=1); "
            f"this tensor is on {device_type}")
    raise BackendUnavailable(f"unknown backend {name!r}; expected one of {', '.join(BACKENDS)}")


def resolve(backend: str, device_type: str, op: str = "apply") -> str:
    """The concrete backend to run ``op`` for ``backend`` on ``device_type``: the one dispatch table decides
    (:func:`syncd.ops._dispatch.resolve`, where every op registers its kernels)."""
    from syncd.ops import _dispatch

    return _dispatch.resolve(op, backend, device_type)


def threads() -> int:
    """Threads the native CPU backend uses: ``SYNCD_NUM_THREADS``, else the CPUs this process may use."""
    env = os.environ.get("SYNCD_NUM_THREADS")
    if env:
        return max(1, int(env))
    return _usable_cpus()


@functools.cache
def _usable_cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1
