"""``syncd tasks``: the shipped agent task family and its verifier QA (``syncd.trainer.agent``).

    syncd tasks qa [--kinds bugfix,detect] [--count 8] [--seed 0] [--out qa.json] [--json] [--strict]
    syncd tasks show KIND INDEX [--seed 0]

``qa`` runs every task's verifier against the reference solution and the known exploits
(``syncd.trainer.agent.qa``), prints one line per task (kept, or quarantined with the reasons) and the
false-positive and false-negative rates, before and after the quarantine; ``--out`` writes the whole report (the
trainer's ``--task-quarantine`` reads it), ``--json`` prints it. ``show`` prints what a task's sandbox gets (its
files) and its prompt -- never the hidden cases. Exit status: 0 done, 1 with ``--strict`` when a task was
quarantined, 2 usage, 3 the machine cannot isolate the grader (``SandboxUnavailable``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

__all__ = ["main", "parser"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="syncd tasks", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    q = sub.add_parser("qa", help="QA of every task's verifier: reference, exploits, quarantine, FP/FN rates")
    q.add_argument("--kinds", default="bugfix,detect", help="task kinds, comma-separated (default: %(default)s)")
    q.add_argument("--count", type=int, default=8, help="tasks per kind (default: %(default)s)")
    q.add_argument("--seed", type=int, default=0, help="the family's seed (default: %(default)s)")
    q.add_argument("--out", default=None, metavar="PATH", help="write the whole report as JSON")
    q.add_argument("--json", action="store_true", help="print the whole report as JSON")
    q.add_argument("--strict", action="store_true", help="exit 1 when a task was quarantined")
    s = sub.add_parser("show", help="a task's files and prompt (what its sandbox gets)")
    s.add_argument("kind")
    s.add_argument("index", type=int)
    s.add_argument("--seed", type=int, default=0)
    return p


def _qa(args, out) -> int:
    from syncd.trainer.agent.qa import qa_suite
    from syncd.trainer.agent.repos import KINDS, make_task

    kinds = [k for k in args.kinds.split(",") if k]
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds or args.count < 1:
        print(f"syncd tasks qa: --kinds must name some of {', '.join(KINDS)} and --count be >= 1", file=sys.stderr)
        return 2
    tasks = [(make_task(i, args.seed, kind), None) for kind in kinds for i in range(args.count)]

    def line(r):
        if not args.json:
            print(f"{r.task_id}: {'QUARANTINED: ' + '; '.join(r.reasons) if r.reasons else 'kept'}", file=out)

    report = qa_suite(tasks, progress=line)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    if args.json:
        print(json.dumps(report, indent=1), file=out)
    else:
        a = report["after"]
        print(f"{report['tasks']} tasks, {report['kept']} kept, {len(report['quarantined'])} quarantined; "
              f"false positives {report['false_positive_rate']:.3f}, false negatives "
              f"{report['false_negative_rate']:.3f}; after the quarantine {a['false_positive_rate']:.3f} and "
              f"{a['false_negative_rate']:.3f}", file=out)
    return 1 if args.strict and report["quarantined"] else 0


def _show(args, out) -> int:
    from syncd.trainer.agent.repos import make_task

    try:
        task = make_task(args.index, args.seed, args.kind)
    except ValueError as exc:
        print(f"syncd tasks show: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"id": task.id, "prompt": task.prompt, "files": task.files}, indent=1), file=out)
    return 0


def main(argv=None, out=None) -> int:
    """Entry point (``syncd tasks ...``); returns the exit status."""
    from syncd.trainer.agent.sandbox import SandboxUnavailable

    out = out or sys.stdout
    p = parser()
    args = p.parse_args(argv)
    if args.command is None:
        p.print_help(sys.stderr)
        return 2
    try:
        return {"qa": _qa, "show": _show}[args.command](args, out)
    except SandboxUnavailable as exc:
        print(f"syncd tasks {args.command}: {exc}", file=sys.stderr)
        return 3


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
