"""``python -m bench``: one driver for every benchmark routine, in the manner of flashinfer's
``benchmarks/flashinfer_benchmark.py`` (``--routine``, shared flags and output columns, ``--refcheck``, a test list).

    python -m bench --list                              # the routines, one line each
    python -m bench --routine codec --preset tiny       # one routine with its own flags (-R NAME also works)
    python -m bench --routine codec --help              # a routine's flags
    python -m bench --tests bench/gpu_checks.txt --results bench/results [--dry-run]

A **routine** is a public module ``bench/NAME.py`` (no leading underscore) that defines ``parser()`` (its
``argparse`` parser, shared output flags added by ``bench._report.output_flags``) and ``main(argv=None) -> int``
ending in ``bench._report.finish``. The driver finds routines by reading the sources (nothing is imported to list
them), so a new module that follows this convention is a routine; ``python -m bench.NAME`` runs the same ``main``.
Every routine takes ``--json PATH`` and ``--plot PNG``, prints its results in the shared columns (routine, backend,
device, sizes, seconds, ratio to its baseline, baseline, refcheck) and writes them to its JSON under ``"table"``;
routines that can check their result against a reference take ``--refcheck`` and exit 1 when a check fails.

``--tests FILE`` runs a test list (``bench/_checks.py``: routine and pytest lines, each in its own process) and
exits 1 if any check failed; ``--dry-run`` only checks the list (routine names, the flags each routine's parser
accepts, pytest paths) and exits 1 on a problem. Exit status 2: a command line refused.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import sys
from pathlib import Path

from bench import _checks

__all__ = ["main", "routines", "run_routine"]

BENCH = Path(__file__).resolve().parent


def _describe(path: Path) -> str | None:
    """The first sentence of the module's docstring if ``path`` defines top-level ``main`` and ``parser``, else None."""
    tree = ast.parse(path.read_text(), str(path))
    names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    if not {"main", "parser"} <= names:
        return None
    para = " ".join((ast.get_docstring(tree) or "").split("\n\n")[0].split())
    first = para.split(". ")[0].rstrip(".")
    return first if len(first) <= 120 else first[:117] + "..."


def routines() -> dict[str, str]:
    """Routine name -> one line of description, for every routine module in ``bench/`` (sorted by name)."""
    found = {}
    for path in sorted(BENCH.glob("*.py")):
        if path.name.startswith("_"):
            continue
        about = _describe(path)
        if about is not None:
            found[path.stem] = about
    return found


def run_routine(name: str, argv: list[str]) -> int:
    """``bench.<name>.main(argv)``; 2 (with the routines named on stderr) when ``name`` is no routine."""
    known = routines()
    if name not in known:
        print(f"python -m bench: no routine {name!r}; routines: {', '.join(known)}", file=sys.stderr)
        return 2
    return importlib.import_module(f"bench.{name}").main(argv)


def _split_routine(argv: list[str]) -> tuple[str, list[str]] | None:
    """(name, the other words) when ``argv`` names a routine (``--routine NAME``, ``--routine=NAME``, ``-R NAME``):
    every word but those two belongs to the routine, so its flags never clash with the driver's."""
    for i, w in enumerate(argv):
        if w.startswith("--routine="):
            return w.split("=", 1)[1], argv[:i] + argv[i + 1:]
        if w in ("--routine", "-R"):
            if i + 1 == len(argv):
                return "", []
            return argv[i + 1], argv[:i] + argv[i + 2:]
    return None


def parser() -> argparse.ArgumentParser:
    """The driver's own flags (a routine's come after ``--routine NAME``)."""
    p = argparse.ArgumentParser(prog="python -m bench", allow_abbrev=False,
                                description="Run a benchmark routine, list them, or run a test list.",
                                epilog="python -m bench --routine NAME [its flags]: one routine (see --list)")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--list", action="store_true", help="list the routines")
    mode.add_argument("--tests", metavar="FILE", help="run the checks of a test list (e.g. bench/gpu_checks.txt)")
    p.add_argument("--results", metavar="DIR", default="bench/results",
                   help="--tests: the results folder ({out} in the list; logs go there)")
    p.add_argument("--dry-run", action="store_true", help="--tests: check the list, run nothing")
    return p


def _tests(args) -> int:
    try:
        checks = _checks.load(args.tests)
    except (OSError, ValueError) as exc:
        print(f"python -m bench: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        problems = _checks.validate(checks, routines())
        for p in problems:
            print(f"{args.tests}: {p}", file=sys.stderr)
        print(f"{args.tests}: {len(checks)} checks, {len(problems)} problems")
        return 1 if problems else 0
    return _checks.run(checks, args.results)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    picked = _split_routine(argv)
    if picked is not None:
        name, rest = picked
        if not name:
            print("python -m bench: --routine needs a name (python -m bench --list)", file=sys.stderr)
            return 2
        return run_routine(name, rest)
    try:
        args = parser().parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    if args.list:
        known = routines()
        width = max(map(len, known), default=0)
        for name, about in known.items():
            print(f"{name:<{width}}  {about}")
        return 0
    return _tests(args)
