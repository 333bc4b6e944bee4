"""Tiny random-init models written by ``syncd.engine.reference.make_tiny``, once per test session."""

from __future__ import annotations

import pytest

from syncd.engine.reference.make_tiny import write_model


@pytest.fixture(scope="session")
def dense_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("tiny-qwen2"), arch="qwen2", seed=1)


@pytest.fixture(scope="session")
def moe_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("tiny-qwen3moe"), arch="qwen3_moe", seed=2)
