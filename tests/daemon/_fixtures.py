"""Fixtures shared by the daemon's and the cluster's process tests (registered by both packages' conftest)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny reference-engine model folder (``make_tiny``), one per test module."""
    from syncd.engine.reference.make_tiny import write_model

    return write_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture
def procs(tmp_path):
    """The test's child processes; every one is killed at teardown, also when the test failed."""
    from tests.daemon._procs import Procs  # imported here: _procs imports the daemon conftest

    p = Procs(tmp_path)
    yield p
    p.close()
