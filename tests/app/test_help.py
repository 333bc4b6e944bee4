"""Every console script (pyproject's [project.scripts], plus `python -m syncd.engine.control_server` and the commands
`syncd` dispatches) answers --help without importing torch: help is instant, not the seconds a torch import takes on a
busy machine. Checked by what is imported, not by a clock."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
CASES = [(name, target, []) for name, target in SCRIPTS.items()] + [
    ("python -m syncd.engine.control_server", "syncd.engine.control_server:main", []),
    ("syncd demo", "syncd.app.cli:main", ["demo"]), ("syncd demo --weights-only", "syncd.app.cli:main",
                                                      ["demo", "--weights-only"]),
    ("syncd serve", "syncd.app.cli:main", ["serve"]), ("syncd train", "syncd.app.cli:main", ["train"]),
    ("syncd materialize", "syncd.app.cli:main", ["materialize"]), ("syncd gc", "syncd.app.cli:main", ["gc"]),
]
PROBE = """
import importlib, sys
module, _, fn = sys.argv[1].partition(":")
main = getattr(importlib.import_module(module), fn)
try:
    rc = main(sys.argv[2:] + ["--help"])
except SystemExit as exc:
    rc = exc.code
print("RC", rc, "TORCH", "torch" in sys.modules)
"""


@pytest.mark.parametrize("name, target, argv", CASES, ids=[c[0] for c in CASES])
def test_help_answers_without_importing_torch(name, target, argv):
    out = subprocess.run([sys.executable, "-c", PROBE, target, *argv], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    last = out.stdout.strip().splitlines()[-1]
    assert last == "RC 0 TORCH False", (name, last, out.stderr[-2000:])
    assert "usage:" in out.stdout


def test_the_demos_help_shows_every_default(monkeypatch):
    """`syncd demo --help` and `--weights-only --help`: each flag described, with its default (0 included)."""
    from syncd.app import demo, rl_demo

    monkeypatch.setenv("COLUMNS", "400")  # one line per flag: no default broken at a hyphen
    for parser in (rl_demo.build_parser(), demo.build_parser()):
        text = parser.format_help()
        for action in parser._actions:
            assert action.help, action.dest
            if action.default is not None and action.default is not False and action.dest != "help":
                assert f"(default: {action.default})" in text, action.dest
    assert "(default: 0)" in rl_demo.build_parser().format_help()  # --seed
