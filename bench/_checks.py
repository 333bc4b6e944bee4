"""Test lists: a file of checks that ``python -m bench --tests FILE`` runs in order, each in its own process
(flashinfer's ``--testlist``). ``bench/gpu_checks.txt`` is the GPU machine's list (``bench/gpu_check.sh`` builds,
then runs it).

A list has one check per line (``#`` starts a comment line; blank lines are skipped; words are split as a POSIX
shell does, quotes included):

* ``== TITLE``: a heading, printed before the checks below it;
* ``--routine NAME [FLAGS...]``: the driver's own command line, ``python -m bench --routine NAME FLAGS``;
* ``pytest [ARGS...]``: ``python -m pytest -q -p no:cacheprovider ARGS``.

Either may end in ``> LOG``: its output then goes to ``LOG`` in the results folder and only its last lines are
printed. ``{out}`` anywhere in a line is the results folder (``--results``). A check fails when its exit status is
not 0; the run goes on and :func:`run` returns 1 if any failed (the failures listed at the end), else 0.
"""

from __future__ import annotations

import contextlib
import io
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from bench._timing import Stopwatch

__all__ = ["Check", "parse", "load", "command", "validate", "run", "ROOT"]

ROOT = Path(__file__).resolve().parents[1]  # the checkout: checks run here
KINDS = ("routine", "pytest")


@dataclass(frozen=True)
class Check:
    """One line of a list: ``kind`` ("routine" or "pytest"), ``args`` (a routine's name first, then its flags; or
    pytest's arguments), ``log`` (file name in the results folder, or None), the heading above it, and its line."""

    kind: str
    args: tuple[str, ...]
    log: str | None
    title: str
    line: int

    def text(self) -> str:
        words = ("--routine", *self.args) if self.kind == "routine" else ("pytest", *self.args)
        return shlex.join(words) + (f" > {self.log}" if self.log else "")


def parse(text: str, source: str = "<list>") -> list[Check]:
    """The checks of a list's ``text``; ValueError naming ``source`` and the line for a line that is none."""
    checks, title = [], ""
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("=="):
            title = line[2:].strip()
            continue
        where = f"{source}:{n}"
        try:
            words = shlex.split(line)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        log = None
        if ">" in words:
            i = words.index(">")
            if i != len(words) - 2:
                raise ValueError(f"{where}: '>' takes one log file name, at the end of the line")
            log, words = words[-1], words[:i]
        if words[0] == "pytest":
            checks.append(Check("pytest", tuple(words[1:]), log, title, n))
        elif words[0] == "--routine":
            if len(words) < 2 or words[1].startswith("-"):
                raise ValueError(f"{where}: --routine needs a routine name")
            checks.append(Check("routine", tuple(words[1:]), log, title, n))
        else:
            raise ValueError(f"{where}: a check starts with --routine or pytest, not {words[0]!r}")
    return checks


def load(path) -> list[Check]:
    """:func:`parse` of the file at ``path`` (OSError when it cannot be read)."""
    return parse(Path(path).read_text(), str(path))


def _fill(words, results: Path) -> list[str]:
    return [w.replace("{out}", str(results)) for w in words]


def command(check: Check, results: Path, python: str = sys.executable) -> list[str]:
    """The argv that runs ``check`` with ``{out}`` replaced by ``results``."""
    if check.kind == "pytest":
        return [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *_fill(check.args, results)]
    return [python, "-m", "bench", "--routine", *_fill(check.args, results)]


def validate(checks: list[Check], routines: dict[str, str]) -> list[str]:
    """Problems found without running anything: a routine not in ``routines`` (name -> description), flags its
    parser refuses, a pytest path that does not exist under :data:`ROOT`. Imports each routine named."""
    import importlib

    problems = []
    for c in checks:
        where = f"line {c.line}"
        if c.kind == "pytest":
            for w in c.args:
                path = w.split("::")[0]
                if not w.startswith("-") and ("/" in path or path.endswith(".py")) and not (ROOT / path).exists():
                    problems.append(f"{where}: no such test path {path}")
            continue
        name, flags = c.args[0], _fill(c.args[1:], Path("/tmp/results"))
        if name not in routines:
            problems.append(f"{where}: no routine {name!r}")
            continue
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                importlib.import_module(f"bench.{name}").parser().parse_args(flags)
        except SystemExit:
            problems.append(f"{where}: {name} refuses {shlex.join(flags)}: {err.getvalue().strip().splitlines()[-1]}")
    return problems


def _subprocess(argv: list[str], log: Path | None) -> int:
    """Run ``argv`` in :data:`ROOT`, its output to ``log`` (stderr too) or to ours; the exit status."""
    if log is None:
        return subprocess.run(argv, cwd=ROOT).returncode
    with open(log, "wb") as fh:
        return subprocess.run(argv, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT).returncode


def _tail(path: Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run(checks: list[Check], results, *, python: str = sys.executable,
        runner: Callable[[list[str], Path | None], int] = _subprocess, tail: int = 20) -> int:
    """Run every check in order (``runner(argv, log_path)`` returns its exit status), printing each heading, the
    command, a logged check's last ``tail`` lines, and a summary. Returns 1 if any check failed, else 0. The results
    folder is made."""
    results = Path(results).resolve()
    results.mkdir(parents=True, exist_ok=True)
    title, done = None, []
    for c in checks:
        if c.title != title:
            title = c.title
            print(f"== {title}", flush=True)
        argv = command(c, results, python)
        log = results / c.log if c.log else None
        print(f"$ {c.text()}", flush=True)
        sw = Stopwatch()
        rc = runner(argv, log)
        done.append((c, rc, sw.elapsed))
        if log is not None:
            print(_tail(log, tail), flush=True)
    failed = [(c, rc) for c, rc, _ in done if rc != 0]
    print(f"\n{len(done) - len(failed)} of {len(done)} checks passed (results in {results})")
    for c, rc, s in done:
        status = "ok" if rc == 0 else f"FAIL {rc}"
        print(f"  {status:<7} {s:7.1f}s  line {c.line}: {c.text()}")
    return 1 if failed else 0
