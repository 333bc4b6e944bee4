"""``checksum``: the 64-bit content checksum of a tensor's bytes, identical on every backend and device.

The definition is in ``syncd/ops/reference/checksum.py`` (the ``reference`` backend, registered by
``syncd/ops/reference/backend.py``) and ``docs/delta-format.md``. It covers the raw
bytes in row-major order (a non-contiguous tensor has its contiguous copy's checksum; the CPU backend reads one
whose elements are evenly spaced, such as the bf16 halves of fp32 weights, in place), not the dtype or shape.
Thread-safe.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from syncd.ops import _backend
from syncd.ops._dispatch import dispatch, kernel, kernel_of, register, resolve
from syncd.ops._tensors import byte_view, even_stride, nbytes_of, raw_ptr


@kernel("checksum", "cpu")
def _checksum_cpu(tensor: torch.Tensor) -> int:
    ptr = raw_ptr(tensor)
    if ptr is not None:
        return int(_backend.native().checksum_ptr(ptr, nbytes_of(tensor), _backend.threads()))
    stride = even_stride(tensor)
    if stride is not None and tensor.numel() and tensor.element_size() in (1, 2, 4, 8):  # no copy
        return int(_backend.native().checksum_strided_ptr(tensor.data_ptr(), tensor.numel(), tensor.element_size(),
                                                          stride, _backend.threads()))
    return int(_backend.native().checksum(byte_view(tensor), _backend.threads()))


@kernel("checksum_bytes", "cpu")  # a 1-d uint8 array
def _checksum_bytes_cpu(arr: np.ndarray) -> int:
    return int(_backend.native().checksum(arr, _backend.threads()))


def _checksum_gpu(name: str, tensor: torch.Tensor) -> int:
    return _backend.gpu_kernels(name).checksum(tensor.detach().contiguous())


for _gpu in ("cuda", "triton"):
    register("checksum", _gpu, functools.partial(_checksum_gpu, _gpu))


def checksum(tensor: torch.Tensor, *, backend: str = "auto") -> int:
    """64-bit checksum (an int in [0, 2**64)) of ``tensor``'s bytes.

    Raises ``BackendUnavailable`` when the named backend cannot run on the tensor's device.
    """
    return dispatch("checksum", backend, tensor.device.type)(tensor)


def checksum_many(tensors, *, backend: str = "auto") -> list[int]:
    """``[checksum(t) for t in tensors]`` using every core across tensors as well as within them (contiguous
    CPU tensors on the CPU backend; anything else goes one by one). The values equal ``checksum``'s."""
    tensors = list(tensors)
    if not tensors or any(resolve("checksum", backend, t.device.type) != "cpu" or raw_ptr(t) is None
                          for t in tensors):
        return [checksum(t, backend=backend) for t in tensors]
    buffers = [(raw_ptr(t), nbytes_of(t)) for t in tensors]  # every 512 KiB piece of every one in one pool
    return [int(c) for c in _backend.native().checksum_many_ptr(buffers, _backend.threads())]


def checksum_bytes(data, *, backend: str = "auto") -> int:
    """The same checksum over a bytes-like object (``bytes``, ``memoryview``, a NumPy array's buffer)."""
    arr = np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1).view(np.uint8)
    name = resolve("checksum", backend, "cpu")  # the bytes are on the host: a GPU backend hashes them as the spec
    return kernel_of("checksum_bytes", "cpu" if name == "cpu" else "reference")(arr)
