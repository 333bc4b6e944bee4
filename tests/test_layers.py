"""The layers point one way (``docs/architecture.md``): ``lint-imports`` (import-linter) checks the contracts in
``pyproject.toml`` on every module, lazy imports included -- ``syncd.ops`` imports nothing else of ours, the
syncd core neither ``syncd.engine`` nor ``syncd.trainer`` (only ``syncd.app`` wires them in), ``syncd.engine`` and
``syncd.trainer`` not each other, nothing but the applications and ``bench`` imports ``syncd.app``, private
modules stay in their package. A broken contract fails this test with import-linter's report of the offending
chain."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: the folders the contracts read; syncd/engine and syncd/trainer are links to engine/ and trainer/
PACKAGES = ("syncd", "engine", "trainer", "bench")


# ``lint-imports`` on the tree at ``root``: the editable install's import finder (which maps our packages to this
# checkout) is set aside first, so that a copy of the tree is analysed as itself
_RUN = """
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__]
sys.path.insert(0, sys.argv[1])
from importlinter.cli import lint_imports_command
sys.argv = ["lint-imports", "--no-cache", "--no-logo", sys.argv[1] + "/pyproject.toml"]
lint_imports_command()
"""


def _lint(root: Path) -> subprocess.CompletedProcess:
    if shutil.which("lint-imports", path=str(Path(sys.executable).parent)) is None:
        pytest.fail("lint-imports is not installed (pip install -e '.[test]' brings import-linter)")
    return subprocess.run([sys.executable, "-c", _RUN, str(root)], cwd=root, capture_output=True, text=True,
                          timeout=300)


def test_the_layer_contracts_hold():
    p = _lint(ROOT)
    assert p.returncode == 0 and "0 broken" in p.stdout, p.stdout + p.stderr
    assert p.stdout.count(" KEPT") == 6, p.stdout


@pytest.mark.parametrize("where, line, contract", [
    ("syncd/ops/checksum_extra.py", "from syncd import store", "syncd.ops imports nothing else"),
    ("syncd/daemon/extra.py", "def f():\n    from syncd.engine.reference import ReferenceEngine",
     "syncd core imports neither"),
    ("syncd/records/extra.py", "from syncd.trainer import loop", "syncd core imports neither"),
    ("trainer/extra.py", "import syncd.engine.state_dict", "syncd.engine and syncd.trainer do not import each other"),
    ("engine/extra.py", "from syncd.app import cli", "only the applications"),
    ("trainer/ft/extra.py", "from syncd.trainer.rl import loop", "run and jobs wire rl and ft"),
    ("trainer/rewards/extra.py", "from syncd.trainer import jobs", "run and jobs wire rl and ft"),
    ("syncd/cache_extra.py", "from syncd.app import cli", "only the applications"),
    ("bench/extra.py", "from syncd.ops import _backend", "private modules stay private"),
])
def test_a_broken_contract_fails_with_its_chain(tmp_path, where, line, contract):
    """The same contracts over a copy of the tree with one offending import added: lint-imports fails, naming
    the contract (so the test above can fail)."""
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so", "results"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / where).parent.mkdir(exist_ok=True)
    (tmp_path / where).write_text(line + "\n")
    p = _lint(tmp_path)
    assert p.returncode != 0, p.stdout
    broken = p.stdout[p.stdout.index("Broken contracts"):]
    assert contract in broken and where.removesuffix(".py").replace("/", ".") in broken, broken


def test_the_core_contract_names_every_core_module():
    """The core's contract lists its source modules one by one (import-linter cannot say "syncd but syncd.app,
    syncd.engine and syncd.trainer"): a new module of the core must be in that list, or it would go unchecked."""
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (core,) = [c for c in contracts if c["name"].startswith("the syncd core imports neither")]
    modules = {f"syncd.{p.stem if p.suffix == '.py' else p.name}" for p in (ROOT / "syncd").iterdir()
               if not p.name.startswith(("_", ".")) and p.name not in ("app", "engine", "trainer")
               and (p.suffix == ".py" or (p / "__init__.py").exists())}
    assert set(core["source_modules"]) == modules
