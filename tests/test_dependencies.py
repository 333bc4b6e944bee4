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
import syncd.engine, syncd.engine.control_server, syncd.engine.proxy.server, syncd.engine.reference.engine, syncd.publish.publisher, syncd.trainer.rl.loop
from syncd.ops import delta
old = torch.zeros(1000, dtype=torch.bfloat16); new = old.clone(); new[::7] = 1
assert torch.equal(delta.decode(old, delta.encode(old, new)), new)
print("zstandard" in sys.modules)
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip().splitlines()[-1] == "False"


def _imports(path: Path) -> set[str]:
    import ast

    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_what_a_module_imports_is_declared_by_its_extra():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    declared = {extra: {d.split(">")[0].split("=")[0].split("[")[0].strip() for d in deps}
                for extra, deps in extras.items()}
    for module, package, extra in [("trainer/rl/curation.py", "mpmath", "trainer"),
                                   ("engine/proxy/compaction.py", "tokenizers", "dynamo")]:
        assert package in _imports(ROOT / module), (module, package)  # the module does import it
        assert package in declared[extra], f"{module} imports {package}: declare it in the {extra} extra"
