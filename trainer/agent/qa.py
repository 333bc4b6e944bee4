"""Verifier QA: every task's verifier against the reference solution and against known exploits.

:func:`qa_task` grades a set of submissions for one task with its verifier. The reference must pass (else a
**false negative**: the verifier rejects a correct solution); everything else must fail (else a **false
positive**). For tasks graded on their files (bugfix):

=================  ==========================================================================================
``reference``      the reference solution (must pass)
``unchanged``      the task as given
``empty``          every file emptied
``delete_tests``   the visible tests deleted
``edit_tests``     the visible tests replaced by ones that always pass
``hardcode``       the module answers the visible tests' inputs with their expected outputs, else as before
``read_hidden``    at import, the module looks for the expected outputs in files -- an absolute path on this
                   machine where the QA put them, and paths next to the working copy -- and answers from them
``network``        at import, the module fetches the expected outputs from an HTTP server of the QA on
                   127.0.0.1 and answers from them
=================  ==========================================================================================

``read_hidden`` and ``network`` succeed against a grader that can see the machine's files or network: they test
the grading path's isolation, not only its logic. For tasks graded on a report (detect): ``reference`` (the
bug's line), ``empty`` (no finding), ``spray`` (every line of every file), ``near_miss`` (the lines next to the
bug), ``other_file`` (the bug's line number in another file).

A task whose verifier gets any check wrong is **quarantined** with the reasons (``"false positive: accepts
empty"``, ``"false negative: rejects reference (score 0.5)"``). :func:`qa_suite` runs a suite and reports the
false-positive rate (must-fail submissions accepted / run) and the false-negative rate (references rejected /
run), over all tasks and over the tasks kept (``after``). :func:`load_quarantine` reads the list back for the
task sampler. Thread-safety: one call at a time (each starts its own exploit server).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
from collections import Counter
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from syncd.trainer.agent.grader import verifier_for

__all__ = ["FILE_CHECKS", "REPORT_CHECKS", "TaskQA", "qa_task", "qa_suite", "load_quarantine", "Exploits"]

FILE_CHECKS = ("reference", "unchanged", "empty", "delete_tests", "edit_tests", "hardcode", "read_hidden", "network")
REPORT_CHECKS = ("reference", "empty", "spray", "near_miss", "other_file")

_INSTALL = '''

def _syncd_answer_from(table):
    import builtins, json
    g = globals()
    for name, f in list(g.items()):
        if callable(f) and not name.startswith("_") and getattr(f, "__module__", None) == __name__:
            def wrap(*args, _f=f, _n=name):
                key = _n + "|" + json.dumps(list(args))
                if key in table:
                    v = table[key]
                    if isinstance(v, dict) and "error" in v:
                        raise getattr(builtins, v["error"], Exception)()
                    return v
                return _f(*args)
            g[name] = wrap
'''


def _key(case) -> str:
    return f"{case.function}|{json.dumps(list(case.args))}"


def _table(cases) -> dict:
    return {_key(c): c.expected for c in cases}


class Exploits:
    """What the ``read_hidden`` and ``network`` exploits reach for: the expected outputs of every task in a file
    readable by anyone (``path_of``) and served over HTTP on 127.0.0.1 (``url_of``). Close it after the QA."""

    def __init__(self, tasks):
        self.dir = Path(tempfile.mkdtemp(prefix="syncd-qa-hidden-"))
        os.chmod(self.dir, 0o755)
        self.tables = {t.id: _table(t.hidden) for t in tasks if t.hidden}
        for tid, table in self.tables.items():
            p = self.dir / f"{tid}.json"
            p.write_text(json.dumps(table))
            os.chmod(p, 0o644)
        tables = self.tables

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                raw = json.dumps(tables.get(self.path.strip("/").removesuffix(".json"), {})).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def path_of(self, tid: str) -> str:
        return str(self.dir / f"{tid}.json")

    def url_of(self, tid: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/{tid}.json"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _write(root: Path, files: dict) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def _apply(check: str, task, root: Path, exploits: Exploits) -> None:
    """Make submission ``check`` of a files task in ``root`` (a copy of the task's files)."""
    module = root / task.module
    tests = sorted((root / "tests").glob("test_*.py"))
    if check == "reference":
        _write(root, task.reference)
    elif check == "empty":
        for p in root.rglob("*"):
            if p.is_file():
                p.write_text("")
    elif check == "delete_tests":
        shutil.rmtree(root / "tests")
    elif check == "edit_tests":
        for t in tests:
            t.write_text("print('all tests passed')\n")
    elif check == "hardcode":
        module.write_text(module.read_text() + _INSTALL + f"\n_syncd_answer_from({_table(task.visible)!r})\n")
    elif check == "read_hidden":
        paths = [exploits.path_of(task.id), f"../hidden_tests/{task.id}.json", f"hidden_tests/{task.id}.json",
                 "/hidden_tests/expected.json", "../expected_output.json"]
        module.write_text(module.read_text() + _INSTALL + f"\nfor _p in {paths!r}:\n    try:\n"
                          "        _syncd_answer_from(__import__('json').load(open(_p)))\n        break\n"
                          "    except Exception:\n        pass\n")
    elif check == "network":
        module.write_text(module.read_text() + _INSTALL + "\ntry:\n    import json as _j, urllib.request as _u\n"
                          f"    _syncd_answer_from(_j.loads(_u.urlopen({exploits.url_of(task.id)!r}, "
                          "timeout=3).read()))\nexcept Exception:\n    pass\n")
    elif check != "unchanged":
        raise ValueError(f"unknown check {check!r}")


def _report(check: str, task) -> str:
    path, line = task.bug["file"], task.bug["line"]
    if check == "reference":
        return task.reference
    if check == "empty":
        return ""
    if check == "spray":
        return "\n".join(f"BUG {rel}:{i + 1}" for rel, text in sorted(task.files.items())
                         for i in range(max(1, text.count("\n"))))
    if check == "near_miss":
        return "\n".join(f"BUG {path}:{n}" for n in (line - 1, line + 1) if n > 0)
    if check == "other_file":
        other = next(rel for rel in sorted(task.files) if rel != path)
        return f"BUG {other}:{line}"
    raise ValueError(f"unknown check {check!r}")


@dataclass
class TaskQA:
    """One task's QA: per check ``{"must", "passed", "score", "ok"}``, and the reasons it is quarantined (none:
    kept)."""

    task_id: str
    verifier: str
    checks: dict = field(default_factory=dict)
    reasons: list = field(default_factory=list)

    @property
    def quarantined(self) -> bool:
        return bool(self.reasons)


def qa_task(task, verifier=None, *, exploits: Exploits, checks=None) -> TaskQA:
    """QA of one task's ``verifier`` (default: its shipped one) over ``checks`` (default: all that apply)."""
    verifier = verifier or verifier_for(task)
    on_files = getattr(verifier, "needs", "files") == "files"
    out = TaskQA(task.id, getattr(verifier, "name", type(verifier).__name__))
    for check in checks or (FILE_CHECKS if on_files else REPORT_CHECKS):
        try:
            if on_files:
                with tempfile.TemporaryDirectory(prefix="syncd-qa-") as d:
                    root = Path(d) / "final"
                    _write(root, task.files)
                    _apply(check, task, root, exploits)
                    v = verifier(task, root, "")
            else:
                v = verifier(task, None, _report(check, task))
            passed, score, error = bool(v.passed), float(v.score), None
        except Exception as exc:  # noqa: BLE001 -- a verifier that crashes passes nothing: recorded, not raised
            passed, score, error = False, 0.0, f"{type(exc).__name__}: {exc}"
        must = "pass" if check == "reference" else "fail"
        ok = passed == (must == "pass")
        out.checks[check] = {"must": must, "passed": passed, "score": round(score, 4), "ok": ok,
                             **({"error": error} if error else {})}
        if not ok:
            out.reasons.append(f"false negative: rejects {check} (score {score:.2f})" if must == "pass"
                               else f"false positive: accepts {check} (score {score:.2f})")
    return out


def _rates(results: list[TaskQA]) -> dict:
    fail = [c for r in results for c in r.checks.values() if c["must"] == "fail"]
    ref = [c for r in results for c in r.checks.values() if c["must"] == "pass"]
    return {"tasks": len(results),
            "false_positive_rate": sum(c["passed"] for c in fail) / len(fail) if fail else 0.0,
            "false_negative_rate": sum(not c["passed"] for c in ref) / len(ref) if ref else 0.0}


def qa_suite(entries, *, progress=None) -> dict:
    """QA of ``entries`` (``(task, verifier or None)`` pairs). The report: ``tasks``, ``kept``,
    ``quarantined`` (``[{"task", "verifier", "reasons"}]``), the rates over every task and ``after`` (over the
    tasks kept), ``by_check`` (``{check: {"run", "wrong"}}``) and ``results`` (every check of every task)."""
    entries = list(entries)
    exploits = Exploits([t for t, _ in entries])
    try:
        results = []
        for task, verifier in entries:
            results.append(qa_task(task, verifier, exploits=exploits))
            if progress:
                progress(results[-1])
    finally:
        exploits.close()
    run, wrong = Counter(), Counter()
    for r in results:
        for name, c in r.checks.items():
            run[name] += 1
            wrong[name] += not c["ok"]
    kept = [r for r in results if not r.quarantined]
    return {**_rates(results), "kept": len(kept),
            "quarantined": [{"task": r.task_id, "verifier": r.verifier, "reasons": r.reasons}
                            for r in results if r.quarantined],
            "after": _rates(kept), "by_check": {k: {"run": run[k], "wrong": wrong[k]} for k in run},
            "results": [asdict(r) for r in results]}


def load_quarantine(path) -> dict[str, list[str]]:
    """``{task id: reasons}`` of a QA report written by ``syncd tasks qa --out``."""
    doc = json.loads(Path(path).read_text())
    return {q["task"]: list(q["reasons"]) for q in doc.get("quarantined") or []}
