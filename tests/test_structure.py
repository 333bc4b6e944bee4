"""The shape of the tree, scanned from the source (independently of import-linter, which checks the layer contracts
in tests/test_layers.py): no module of ours over 450 lines; one trainer step loop (only ``syncd.trainer.rl.loop``
calls ``begin_step()``/``commit()`` on a data-parallel object); no top-level ``engine``/``trainer`` imports (they
are ``syncd.engine``/``syncd.trainer``); no production module imports an old path of a moved module."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the packages' real folders (syncd/engine and syncd/trainer are links to engine/ and trainer/: not walked twice)
FOLDERS = ("syncd", "engine", "trainer", "bench")
MAX_LINES = 450


def _modules():
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if "__pycache__" in rel.parts or rel.parts[:2] in (("syncd", "engine"), ("syncd", "trainer")):
                continue
            yield rel, path.read_text()


def _imported(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_no_module_is_over_450_lines():
    long = {str(rel): n for rel, text in _modules() if (n := len(text.splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_engine_and_trainer_are_imported_as_syncd_engine_and_syncd_trainer():
    bad = {}
    for rel, text in _modules():
        tops = {name for name in _imported(ast.parse(text)) if name.split(".")[0] in ("engine", "trainer")}
        if tops:
            bad[str(rel)] = sorted(tops)
    assert not bad, bad


def test_the_trainer_step_is_written_once():
    """Only the one loop drives a step: ``X.begin_step()`` and ``X.commit()`` are called in syncd.trainer.rl.loop and
    nowhere else in the trainer (docstrings may show them)."""
    callers = {}
    for rel, text in _modules():
        if rel.parts[0] != "trainer":
            continue
        for node in ast.walk(ast.parse(text)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("begin_step", "commit") and not node.args):
                callers.setdefault(str(rel), set()).add(node.func.attr)
    assert callers == {"trainer/rl/loop.py": {"begin_step", "commit"}}, callers


def test_no_old_module_paths_remain():
    old = {"syncd.cli", "syncd.demo", "syncd.rl_demo", "syncd.rl_stack", "syncd.daemon.manifests",
           "syncd.daemon.recovery", "syncd.engine.adapter", "syncd.engine.replay.format", "syncd.engine.control",
           "syncd.engine.updater", "syncd.engine.staging", "syncd.engine.local_params", "syncd.trainer.publisher",
           "syncd.trainer.shard_writer", "syncd.trainer.version_numbers", "syncd.trainer.elastic_loop",
           "syncd.trainer.loop"}
    found = {str(rel): sorted(_imported(ast.parse(text)) & old) for rel, text in _modules()}
    assert not {k: v for k, v in found.items() if v}
