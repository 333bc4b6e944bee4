"""``syncd.ops._dispatch``: an op the table does not know (a typo, or its module not imported) is a ValueError that
names the registered ops, on every entry point; ``kernel_of`` is part of the module's surface."""

from __future__ import annotations

import pytest

import syncd.ops.nvfp4  # noqa: F401 -- registers the nvfp4 ops
from syncd.ops import _dispatch


@pytest.mark.parametrize("call", [
    lambda: _dispatch.backends_of("nvfp4_scal"), lambda: _dispatch.resolve("nvfp4_scal", "auto", "cpu"),
    lambda: _dispatch.resolve("nvfp4_scal", "cpu", "cpu"), lambda: _dispatch.dispatch("nvfp4_scal", "auto", "cpu"),
    lambda: _dispatch.kernel_of("nvfp4_scal", "cpu")])
def test_an_unknown_op_is_a_value_error_naming_the_registered_ops(call):
    with pytest.raises(ValueError, match=r"unknown op 'nvfp4_scal'; registered: .*nvfp4_scale"):
        call()


def test_kernel_of_is_exported_and_refuses_a_backend_without_a_kernel():
    assert "kernel_of" in _dispatch.__all__
    assert _dispatch.kernel_of("nvfp4_scale", "reference") is _dispatch.dispatch("nvfp4_scale", "reference", "cpu")
    _dispatch.register("test_only_op", "reference", lambda: None)
    try:
        with pytest.raises(ValueError, match="test_only_op has no cpu kernel .*reference"):
            _dispatch.kernel_of("test_only_op", "cpu")
    finally:
        del _dispatch._TABLE["test_only_op"]
