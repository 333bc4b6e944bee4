"""zstandard is the codec benchmark's (its baselines), not a core dependency: the core, the engine and the trainer
encode, publish, read and apply versions without importing it (pyproject: the bench and test extras)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_zstandard_is_only_the_benchmarks():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.startswith("zstandard")]
    assert any(d.startswith("zstandard") for d in project["optional-dependencies"]["bench"])
    code = """
import sys, torch
import syncd, syncd.app.cli, syncd.daemon, syncd.cluster, syncd.versions, syncd.model_folder
import engine, engine.control_server, engine.proxy.server, engine.reference.engine, trainer.publisher, trainer.loop
from syncd.ops import delta
old = torch.zeros(1000, dtype=torch.bfloat16); new = old.clone(); new[::7] = 1
assert torch.equal(delta.decode(old, delta.encode(old, new)), new)
print("zstandard" in sys.modules)
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip().splitlines()[-1] == "False"
