"""Runs the hostile-blob fuzz tests against an AddressSanitizer + UBSan build of the native module."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.integration
def test_fuzz_under_address_sanitizer(tmp_path_factory):
    if not shutil.which("cmake") or not shutil.which("ninja") and not Path(sys.prefix, "bin", "ninja").exists():
        pytest.fail("cmake and ninja are needed to build the sanitized module (pip install ninja cmake)")
    build = tmp_path_factory.mktemp("asan")
    env = dict(os.environ, PYTHON=sys.executable, SYNCD_FUZZ_EXAMPLES="150",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("SYNCD_NATIVE_DIR", None)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "asan_fuzz.sh"), str(build)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, _excerpt(out)
    assert "ERROR: AddressSanitizer" not in out and "runtime error:" not in out, _excerpt(out)
    assert " passed" in out
    # the sanitized module really was the one under test
    assert list(build.glob("_native*.so"))


def _excerpt(out: str, n: int = 6000) -> str:
    """The sanitizer's report when there is one (the Python traceback after it is long), else the tail."""
    at = min((i for i in (out.find("ERROR: AddressSanitizer"), out.find("runtime error:")) if i >= 0), default=-1)
    return out[max(0, at - 200):at - 200 + n] if at >= 0 else out[-n:]
