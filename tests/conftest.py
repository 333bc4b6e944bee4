"""Test-wide setup: Triton kernels run interpreted on the CPU unless a CUDA GPU is present."""

import os

import pytest


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        return False


HAS_CUDA = _cuda_available()
if not HAS_CUDA:
    # must be set before any triton.jit decorator runs
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (runs in bench/gpu_check.sh on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
