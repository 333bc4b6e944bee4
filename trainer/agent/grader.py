"""Verifiers: the grading path, outside the agent's sandbox.

A verifier is a callable ``(task, final, report) -> Verdict``: ``final`` is the grader's copy of the working copy's
final state (``Sandbox.snapshot``, a folder the agent never saw; None for a task graded on its report), ``report``
the agent's final answer text. Built-ins for the task family of :mod:`syncd.trainer.agent.repos`:

* :class:`HiddenTests` (bugfix): a fresh grader sandbox over a copy of ``final`` runs a probe that imports the
  module and calls every hidden case, printing the outputs as JSON; the outputs are compared with the expected
  ones **here**, outside any sandbox (``allow_unisolated``: run the probe without namespaces where the
  machine has none -- the QA's ``read_hidden`` and ``network`` exploits then pass and quarantine the task): the expected outputs never enter one, so nothing the agent wrote (tests
  deleted or edited, outputs hard-coded for the visible cases, code reading files or the network at grading
  time) can make a wrong module pass. The agent's own tests are not run.
* :class:`ReportedFindings` (detect): parses ``BUG <path>:<line>`` lines of the report and scores them against the
  injected bug with :class:`syncd.trainer.rewards.SWECheckReward` (a finding matches within ``tolerance`` lines);
  it passes at ``pass_at``.
* :class:`VisibleTests`: runs the working copy's own tests -- a *bad* verifier (it trusts files the agent can
  write), kept for the QA's tests (``syncd.trainer.agent.qa``), which must quarantine it.

Everything the probe prints is hostile: only its last line is read, as bounded strict JSON of the right shape.
Thread-safety: verifiers are stateless; each call makes its own sandbox.
"""

from __future__ import annotations

import json
import math
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from syncd.trainer.agent.sandbox import Limits, Sandbox
from syncd.trainer.rewards import LinearizedReward, SWECheckReward

__all__ = ["Verdict", "HiddenTests", "ReportedFindings", "VisibleTests", "parse_findings", "GRADER_LIMITS",
           "verifier_for", "grade_snapshot"]

GRADER_LIMITS = Limits(timeout_s=20, cpu_s=20, output_bytes=256 << 10)
_PROBE = "_syncd_probe.py"
_FINDING = re.compile(r"BUG\s+([A-Za-z0-9_./-]{1,200}):(\d{1,6})")
MAX_FINDINGS = 64


@dataclass(frozen=True)
class Verdict:
    """``passed``, a ``score`` in [0, 1] and what decided it (``detail``)."""

    passed: bool
    score: float
    detail: dict = field(default_factory=dict)


def _probe(module: str, cases) -> str:
    calls = json.dumps([[c.function, c.args] for c in cases])
    return (f"import importlib.util, json, sys\nsys.path.insert(0, '.')\nCALLS = json.loads({calls!r})\nout = []\n"
            f"try:\n    spec = importlib.util.spec_from_file_location('target', {module!r})\n"
            "    m = importlib.util.module_from_spec(spec)\n    spec.loader.exec_module(m)\n"
            "except BaseException as exc:\n    print(json.dumps({'import_error': type(exc).__name__}))\n"
            "    sys.exit(3)\nfor name, args in CALLS:\n    try:\n"
            "        out.append({'value': json.loads(json.dumps(getattr(m, name)(*args)))})\n"
            "    except BaseException as exc:\n        out.append({'error': type(exc).__name__})\n"
            "sys.stdout.write('\\n' + json.dumps(out) + '\\n')\nsys.stdout.flush()\n")


def _same(got, want) -> bool:
    if isinstance(want, dict) and "error" in want:
        return isinstance(got, dict) and got.get("error") == want["error"]
    if not isinstance(got, dict) or "value" not in got:
        return False
    v = got["value"]
    if isinstance(want, float) and isinstance(v, (int, float)) and not isinstance(v, bool):
        return math.isclose(v, want, rel_tol=1e-9, abs_tol=1e-9)
    return type(v) is type(want) and v == want


@dataclass(frozen=True)
class HiddenTests:
    """The bugfix verifier (module docstring). ``cases``: override the task's hidden cases (tests plant wrong
    ones this way); ``limits``: the grader sandbox's."""

    cases: tuple | None = None
    limits: Limits = GRADER_LIMITS
    allow_unisolated: bool = False
    name: str = "hidden_tests"
    needs: str = "files"

    def __call__(self, task, final: Path | None, report: str = "") -> Verdict:
        cases = task.hidden if self.cases is None else self.cases
        if final is None or not cases:
            return Verdict(False, 0.0, {"reason": "nothing to grade"})
        with Sandbox.create(final, limits=self.limits, exclude=(), allow_unisolated=self.allow_unisolated) as sb:
            sb.write_files({_PROBE: _probe(task.module, cases)})
            r = sb.run(f"python3 {_PROBE}")
        lines = r.stdout.strip().splitlines()
        try:
            got = json.loads(lines[-1]) if lines and len(lines[-1]) < 200_000 else None
        except ValueError:
            got = None
        if not isinstance(got, list) or len(got) != len(cases):
            return Verdict(False, 0.0, {"reason": "no results", "exit_code": r.exit_code, "killed": r.killed,
                                        "stderr": r.stderr[-500:]})
        ok = [_same(g, c.expected) for g, c in zip(got, cases)]
        failed = [f"{c.function}{tuple(c.args)}" for c, good in zip(cases, ok) if not good]
        return Verdict(all(ok), sum(ok) / len(ok), {"failed": failed[:10], "cases": len(ok)})


def parse_findings(report: str) -> list[tuple[str, int]]:
    """The ``BUG <path>:<line>`` findings of a report, in order, each once (at most ``MAX_FINDINGS``; any more
    make the report count as that many findings, so a spray of findings never passes)."""
    out: list[tuple[str, int]] = []
    for path, line in _FINDING.findall(report or ""):
        f = (path[2:] if path.startswith("./") else path, int(line))
        if f not in out:
            out.append(f)
    return out[:MAX_FINDINGS]


@dataclass(frozen=True)
class ReportedFindings:
    """The detect verifier (module docstring): the linearized F_beta reward of the findings, normalised to [0, 1];
    passes at ``pass_at``."""

    beta: float = 0.5
    tolerance: int = 0
    pass_at: float = 0.99
    name: str = "reported_findings"
    needs: str = "report"

    def reward(self) -> SWECheckReward:
        lin = LinearizedReward.at(self.beta, 0.6, 0.3)
        return SWECheckReward(parse=parse_findings, linearized=lin, scope_ok=None,
                              match=lambda p, t: p[0] == t["file"] and abs(p[1] - t["line"]) <= self.tolerance)

    def __call__(self, task, final: Path | None, report: str = "") -> Verdict:
        sample = SimpleNamespace(item=SimpleNamespace(index=0, meta={"bugs": [task.bug]}), completion=report or "",
                                 step=0, completion_tokens=0)
        reward = self.reward()
        score = float(reward(sample))
        s = reward.score(sample)
        return Verdict(score >= self.pass_at, score, {"precision": s.precision, "recall": s.recall,
                                                      "findings": len(parse_findings(report))})


@dataclass(frozen=True)
class VisibleTests:
    """A bad verifier: passes when the working copy's own tests exit 0 (the agent can edit or delete them)."""

    limits: Limits = GRADER_LIMITS
    name: str = "visible_tests"
    needs: str = "files"

    def __call__(self, task, final: Path | None, report: str = "") -> Verdict:
        if final is None:
            return Verdict(False, 0.0, {"reason": "nothing to grade"})
        with Sandbox.create(final, limits=self.limits, exclude=()) as sb:
            r = sb.run("for t in tests/test_*.py; do [ -e \"$t\" ] || continue; python3 \"$t\" || exit 1; done")
        return Verdict(r.ok, float(r.ok), {"exit_code": r.exit_code})


def verifier_for(task):
    """The shipped verifier of a task of :mod:`syncd.trainer.agent.repos`."""
    return HiddenTests() if task.kind == "bugfix" else ReportedFindings()


def grade_snapshot(sb: Sandbox, task, report: str, verifier=None) -> Verdict:
    """Grade a finished sandbox: its final state copied into a folder the sandbox never saw, then the verifier."""
    verifier = verifier or verifier_for(task)
    if getattr(verifier, "needs", "files") == "report":
        return verifier(task, None, report)
    with tempfile.TemporaryDirectory(prefix="syncd-grade-") as d:
        return verifier(task, sb.snapshot(Path(d) / "final"), report)
