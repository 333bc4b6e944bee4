"""README.md against the code: every ``SYNCD_*`` variable the code reads is in one of the README's variable tables
(a ``SYNCD_CLUSTER_<FLAG>`` row covers its family), and every console script of pyproject is named under "Command
line"."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
_DOCSTRING_EXAMPLES = {"SYNCD_X"}  # syncd.app.cli's help formatter documents its own pattern with it


def _variables_in_code() -> set[str]:
    found = set()
    for folder in ("syncd", "engine", "trainer", "bench", "tests", "scripts"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".sh") and path.name != "test_readme.py":
                found |= set(re.findall(r"SYNCD_[A-Z0-9_]*[A-Z0-9]", path.read_text(errors="replace")))
    found |= set(re.findall(r'env = "(SYNCD_[A-Z0-9_]+)"', (ROOT / "pyproject.toml").read_text()))
    return found - _DOCSTRING_EXAMPLES


def test_every_variable_the_code_reads_is_in_a_readme_table():
    rows = [ln for ln in README.splitlines() if ln.startswith("|")]
    listed = set(re.findall(r"SYNCD_[A-Z0-9_]*[A-Z0-9]", "\n".join(rows)))
    families = [m for m in re.findall(r"(SYNCD_[A-Z0-9_]+_)<[A-Z]+>", "\n".join(rows))]
    missing = sorted(v for v in _variables_in_code()
                     if v not in listed and not any(v.startswith(f) for f in families)
                     and not any(w.startswith(v + "_") for w in listed))  # a prefix named in prose (SYNCD_DYNAMO_*)
    assert not missing, f"SYNCD_* variables read by the code but not in a README table: {missing}"


def test_every_console_script_is_listed_under_command_line():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    section = README.split("## Command line", 1)[1].split("\n## ", 1)[0]
    missing = [name for name in scripts if not re.search(rf"`{re.escape(name)}`", section)]
    assert not missing, f"console scripts not named under 'Command line': {missing}"
