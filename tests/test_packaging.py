"""One shipped import name: the installed distribution exposes ``syncd`` alone (``syncd.engine`` and
``syncd.trainer`` are the repository's ``engine/`` and ``trainer/``), so a user project with its own ``trainer``
and ``engine`` packages imports both its own and syncd's, in the editable install the test suite runs on and in a
regular wheel."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_USER_CODE = """
import importlib.util, sys
import trainer, engine
from syncd.trainer import WeightPublisher
from syncd.engine.reference import ReferenceEngine
import syncd.engine, syncd.trainer
assert trainer.OWN == "user trainer" and engine.OWN == "user engine", (trainer, engine)
assert syncd.trainer.__name__ == "syncd.trainer" and syncd.engine.__name__ == "syncd.engine"
assert importlib.util.find_spec("bench") is None, "bench is importable outside a checkout"
print("ok", trainer.__file__, syncd.trainer.__file__)
"""


def test_a_user_project_with_its_own_trainer_and_engine_imports_both(tmp_path):
    for name in ("trainer", "engine"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f'OWN = "user {name}"\n')
    p = subprocess.run([sys.executable, "-c", _USER_CODE], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    own, ours = p.stdout.split()[1:3]
    assert Path(own).parent.parent == tmp_path and Path(ours).resolve().parent == ROOT / "trainer"


def test_outside_a_checkout_only_syncd_is_importable(tmp_path):
    code = ("import importlib.util\n"
            "print([n for n in ('syncd', 'engine', 'trainer', 'bench', 'tests') if importlib.util.find_spec(n)])")
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "['syncd']"


def test_the_wheel_ships_syncd_alone_with_engine_and_trainer_inside(tmp_path):
    """A regular wheel (the Python files; the native modules are left to CMake and not built here)."""
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps",
                        "-C", "wheel.cmake=false", "-w", str(tmp_path), str(ROOT)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    (wheel,) = tmp_path.glob("syncd-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"syncd", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1]
                                                + ".dist-info"}
    for folder in ("engine", "trainer"):
        sources = {f"syncd/{p.relative_to(ROOT).as_posix()}" for p in (ROOT / folder).rglob("*.py")}
        assert sources and sources <= set(names), sorted(sources - set(names))
    assert "syncd/ops/delta.py" in names and not [n for n in names if n.startswith(("bench/", "syncd/bench/"))]
