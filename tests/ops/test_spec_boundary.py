"""The specification stays the specification: production code reaches ``syncd/ops/reference/`` only through the
dispatch table's ``reference`` entries, which ``syncd/ops/_dispatch.py`` has the reference backend
(``syncd/ops/reference/backend.py``) register. An AST scan of every module of ``syncd/``, ``engine/`` and ``trainer/``
(tests and benchmarks may use the specification directly)."""

from __future__ import annotations

import ast
import os
from pathlib import Path

from syncd.ops import _dispatch

ROOT = Path(__file__).resolve().parents[2]
SPEC = "syncd.ops.reference"
#: where production code lives, and the package each folder is (engine/ and trainer/ are syncd.engine, syncd.trainer)
PACKAGES = {"syncd": "syncd", "engine": "syncd.engine", "trainer": "syncd.trainer"}
#: the only modules outside the specification that may import it
ALLOWED = {"syncd/ops/_dispatch.py"}


def _modules():
    """``(path relative to the root, dotted package the module's relative imports start from)``. Symlinked folders
    (syncd/engine, syncd/trainer) are not followed: their targets are scanned as engine/ and trainer/."""
    for folder, package in PACKAGES.items():
        for here, dirs, files in os.walk(ROOT / folder):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not (Path(here) / d).is_symlink())
            rel = Path(here).relative_to(ROOT / folder)
            pkg = ".".join([package, *rel.parts])
            for name in sorted(files):
                if name.endswith(".py"):
                    yield (Path(here) / name).relative_to(ROOT).as_posix(), pkg


def _imported(tree: ast.AST, pkg: str):
    """``(line, dotted name)`` of everything a module imports: modules and ``from`` names, relative ones resolved,
    and the string a call to ``import_module`` / ``__import__`` names."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*parts, base] if base else parts)
            yield node.lineno, base
            for a in node.names:
                yield node.lineno, f"{base}.{a.name}"
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                yield node.lineno, node.args[0].value


def test_only_the_dispatch_table_imports_the_specification():
    found: dict[str, str] = {}
    for path, pkg in _modules():
        if path.startswith("syncd/ops/reference/") or path in ALLOWED:
            continue
        tree = ast.parse((ROOT / path).read_text(), filename=path)
        for line, name in _imported(tree, pkg):
            if name == SPEC or name.startswith(SPEC + "."):
                found.setdefault(f"{path}:{line}", name)
    assert not found, "production code imports the specification (use the op, or a helper of syncd.ops):\n" + \
        "\n".join(f"{where} imports {name}" for where, name in found.items())


def test_the_scan_sees_every_form_of_import():
    forms = ["import syncd.ops.reference.delta", "from syncd.ops.reference import delta",
             "from syncd.ops import reference", "from .reference import delta", "from . import reference",
             "from ..reference.replay import kept_rows", "importlib.import_module('syncd.ops.reference.nvfp4')"]
    pkg = {"from ..reference.replay import kept_rows": "syncd.ops.replay"}
    for src in forms:
        names = [n for _, n in _imported(ast.parse(src), pkg.get(src, "syncd.ops"))]
        assert any(n == SPEC or n.startswith(SPEC + ".") for n in names), (src, names)
    assert not any(n.startswith(SPEC) for _, n in _imported(ast.parse("from syncd.ops import replay"), "syncd"))


def test_every_op_has_a_reference_entry_from_the_specification():
    for op in sorted(_dispatch._TABLE):
        assert "reference" in _dispatch.backends_of(op), op
        entry = _dispatch.kernel_of(op, "reference")
        for fn in entry if isinstance(entry, tuple) else (entry,):
            assert fn.__module__.startswith(SPEC + "."), (op, fn.__module__)
