"""Test-wide setup: Triton kernels run interpreted on the CPU unless a CUDA GPU is present."""

import os
import tempfile

import pytest


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        return False


# the engine-control token of this test session (engines create it, daemons and clients read it), so that
# tests never touch the real ~/.config/syncd/engine-token; child processes inherit the variable
os.environ.setdefault("SYNCD_ENGINE_TOKEN_FILE", os.path.join(tempfile.mkdtemp(prefix="syncd-test-token-"),
                                                              "engine-token"))

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
