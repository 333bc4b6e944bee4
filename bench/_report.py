"""What every benchmark routine shares at its two ends: the output flags, and the one epilogue.

A routine (a public module ``bench/NAME.py`` with ``parser()`` and ``main(argv=None) -> int``; see
``bench/_driver.py``) builds its ``argparse`` parser, calls :func:`output_flags` on it, runs, and ends with
``return finish(NAME, args, out, rows, draw)``:

* ``--json PATH``: the routine's JSON document ``out`` (its own fields), plus ``"table"``: its result rows in the
  shared columns. Default ``$SYNCD_BENCH_OUT``, else ``bench/results/NAME.json`` (relative to the working folder).
* ``--plot PNG``: ``draw(path)`` draws the routine's figure there (matplotlib, ``bench._plot``); no PNG without it.
* ``--refcheck`` (only routines that can check their result against a reference, when asked to): the rows carry
  the outcome, and :func:`finish` returns :data:`CHECK_FAILED` when any row's check failed.

The shared columns (:class:`Row`, printed as one table by :func:`finish`): routine, backend (what was measured: a
backend, a format, a mode), device, sizes, seconds (the median unless the routine says otherwise), ratio to its
baseline (> 1: better than the baseline, i.e. baseline seconds / seconds, or rate / baseline rate), baseline (what
the ratio compares against) and refcheck (``ok``, ``FAIL``, or ``-`` when not checked). Routines whose check is
part of every run (e.g. ``bench.nvfp4``'s bit-exact backends) fill the refcheck column without the flag.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable

__all__ = ["Row", "output_flags", "finish", "format_table", "model_params", "CHECK_FAILED", "COLUMNS"]

#: the exit status of a routine whose reference check failed (2 stays the status of a refused command line)
CHECK_FAILED = 1
COLUMNS = ("routine", "backend", "device", "sizes", "seconds", "ratio", "baseline", "refcheck")


@dataclass(frozen=True)
class Row:
    """One result in the shared columns (the routine's name is added by :func:`finish`). ``seconds``: seconds of
    the measured thing (None where the figure is not a time); ``ratio``: its ratio to ``baseline`` (> 1 is better
    than the baseline); ``refcheck``: True / False for a check made, None for none."""

    backend: str
    seconds: float | None
    ratio: float | None = None
    baseline: str = ""
    sizes: str = ""
    device: str = "cpu"
    refcheck: bool | None = None


def model_params(folder) -> int:
    """How many parameters a model folder's safetensors files hold, for a routine's report (from their headers:
    shapes only, no tensor is read)."""
    from safetensors import safe_open

    total = 0
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            total += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
    return total


def output_flags(parser, routine: str, *, refcheck: str | None = None) -> None:
    """Add the shared output flags to a routine's ``parser``: ``--json PATH`` (default ``$SYNCD_BENCH_OUT`` or
    ``bench/results/<routine>.json``), ``--plot PNG``, and, when ``refcheck`` (its help: what is checked against
    what) is given, ``--refcheck``."""
    default = os.environ.get("SYNCD_BENCH_OUT") or f"bench/results/{routine}.json"
    parser.add_argument("--json", metavar="PATH", default=default,
                        help=f"write the figures as JSON here (default {default})")
    parser.add_argument("--plot", metavar="PNG", default=None, help="also draw the figures to this PNG (matplotlib)")
    if refcheck:
        parser.add_argument("--refcheck", action="store_true", help=refcheck)


def _cell(x, spec: str) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, spec)


def _check(ok: bool | None) -> str:
    return "-" if ok is None else ("ok" if ok else "FAIL")


def format_table(routine: str, rows: Iterable[Row]) -> str:
    """The rows as a fixed-width table under a header of the shared columns."""
    lines = [f"{'routine':<14} {'backend':<34} {'device':<10} {'sizes':<34} {'seconds':>10} {'ratio':>8}  "
             f"{'baseline':<34} refcheck"]
    for r in rows:
        ratio = _cell(r.ratio, ".2f") + ("x" if r.ratio is not None else "")
        lines.append(f"{routine:<14} {r.backend:<34} {r.device:<10} {r.sizes:<34} {_cell(r.seconds, '10.4g'):>10} "
                     f"{ratio:>8}  {r.baseline:<34} {_check(r.refcheck)}")
    return "\n".join(lines)


def finish(routine: str, args, out: dict, rows: Iterable[Row], draw: Callable[[Path], object] | None = None) -> int:
    """The epilogue of every routine: print ``rows`` in the shared columns, write ``out`` (with the rows under
    ``"table"``) to ``args.json``, draw ``draw(Path(args.plot))`` when ``--plot`` was given, and return 0, or
    :data:`CHECK_FAILED` when a row's reference check failed (named on stderr). ``out`` is modified (``"table"``);
    OSError from writing and the plot's errors (ImportError without matplotlib) propagate."""
    rows = list(rows)
    print("\n" + format_table(routine, rows))
    out["table"] = [{"routine": routine, **asdict(r)} for r in rows]
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1))
        print(f"results written to {path}")
    if args.plot and draw is not None:
        draw(Path(args.plot))
        print(f"plot written to {args.plot}")
    failed = [f"{r.backend} ({r.sizes})" if r.sizes else r.backend for r in rows if r.refcheck is False]
    if failed:
        print(f"{routine}: REFCHECK FAILED: {'; '.join(failed)}", file=sys.stderr)
        return CHECK_FAILED
    return 0
