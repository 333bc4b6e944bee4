"""The layers replay spans point one way: ``trainer`` never imports ``engine`` (it reads the engines' records
through ``syncd.records``), ``syncd/ops`` imports nothing else of ours, and ``syncd.records`` (core) imports
neither ``engine`` nor ``trainer``. Checked on the source, every import statement, lazy ones included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
    return out


def _offenders(folder: str, forbidden) -> list[str]:
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for mod in _imports(path):
            top = mod.split(".")[0]
            if forbidden(mod, top):
                bad.append(f"{path.relative_to(ROOT)} imports {mod}")
    return bad


@pytest.mark.parametrize("folder, rule, forbidden", [
    ("trainer", "trainer never imports engine", lambda mod, top: top == "engine"),
    ("syncd/ops", "syncd/ops imports nothing else of ours",
     lambda mod, top: top in ("engine", "trainer", "bench") or (top == "syncd" and not (
         mod.startswith("syncd.ops") or mod in ("syncd.errors", "syncd._native", "syncd._cuda_native")))),
    ("syncd/records", "the core never imports engine or trainer", lambda mod, top: top in ("engine", "trainer")),
])
def test_layers_point_one_way(folder, rule, forbidden):
    assert _offenders(folder, forbidden) == [], rule
