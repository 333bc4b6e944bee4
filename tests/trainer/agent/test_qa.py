"""The shipped task family and the verifier QA (``syncd.trainer.agent.repos``, ``.grader``, ``.qa``, ``syncd tasks``):
a suite with planted bad verifiers -- one that accepts an empty change (it runs the agent's own tests), one that
rejects the reference (a wrong expected output), one that accepts a spray of findings -- gets exactly those
quarantined, each with the right reason, and no good task; a grader without isolation is caught by the exploits
that read the machine's files and network."""

from __future__ import annotations

import io
import json
import os

import pytest

from syncd.trainer.agent import sandbox as sbx
from syncd.trainer.agent.grader import HiddenTests, ReportedFindings, VisibleTests
from syncd.trainer.agent.qa import load_quarantine, qa_suite
from syncd.trainer.agent.repos import Case, make_task

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the grader's jail needs root (CI runs as root)")


def test_tasks_are_deterministic_and_their_files_hold_no_answer():
    a, b = make_task(3, 7), make_task(3, 7)
    assert a == b and make_task(4, 7) != a
    for t in (a, make_task(3, 7, "detect")):
        text = json.dumps(t.files)
        assert t.module in t.files and "hidden" not in text
        assert t.reference != t.files.get(t.module) and t.bug["file"] == t.module
        assert set(t.meta()) == {"task_id", "kind", "module", "bugs"}
    fixed = a.reference[a.module]
    assert a.files[a.module].splitlines()[a.bug["line"] - 1] != fixed.splitlines()[a.bug["line"] - 1]
    assert sum(c.function == a.bug["function"] for c in a.hidden) >= 4


def test_the_unchanged_task_fails_its_visible_tests_and_the_reference_passes(tmp_path):
    t = make_task(1, 0)
    test = next(p for p in t.files if p.startswith("tests/"))
    with sbx.Sandbox.create(t.files, parent=tmp_path) as s:
        assert s.run(f"python3 {test}").exit_code == 1
        s.write_files(t.reference)
        r = s.run(f"python3 {test}")
        assert r.ok, r.text()


def test_planted_bad_verifiers_are_quarantined_with_the_reason_and_no_good_task_is():
    good = [(make_task(i, 1, kind), None) for kind in ("bugfix", "detect") for i in range(2)]
    empty_ok = make_task(10, 1)
    ref_bad = make_task(11, 1)
    wrong = tuple(Case(c.function, c.args, "not this") if i == 0 else c for i, c in enumerate(ref_bad.hidden))
    spray_ok = make_task(12, 1, "detect")
    planted = {empty_ok.id: "false positive: accepts empty", ref_bad.id: "false negative: rejects reference",
               spray_ok.id: "false positive: accepts spray"}
    report = qa_suite(good + [(empty_ok, VisibleTests()), (ref_bad, HiddenTests(cases=wrong)),
                              (spray_ok, ReportedFindings(pass_at=0.5))])
    got = {q["task"]: q["reasons"] for q in report["quarantined"]}
    assert set(got) == set(planted), got
    for tid, reason in planted.items():
        assert any(r.startswith(reason) for r in got[tid]), (tid, got[tid])
    assert got[empty_ok.id] and all(r.startswith("false positive") for r in got[empty_ok.id])
    assert report["kept"] == len(good)
    assert report["false_positive_rate"] > 0 and report["false_negative_rate"] > 0
    assert report["after"] == {"tasks": len(good), "false_positive_rate": 0.0, "false_negative_rate": 0.0}
    # every exploit ran against the good bugfix tasks and was refused
    checks = {c for r in report["results"] if r["task_id"].startswith("bugfix-1-") for c in r["checks"]}
    assert {"unchanged", "empty", "delete_tests", "edit_tests", "hardcode", "read_hidden", "network"} <= checks


def test_a_grader_that_sees_the_machine_is_caught_by_the_exploits(monkeypatch):
    """The read_hidden and network exploits are live: against a grader without namespaces they pass."""
    monkeypatch.setattr(sbx, "isolation", lambda: "none")
    report = qa_suite([(make_task(0, 2), HiddenTests(allow_unisolated=True))])
    (q,) = report["quarantined"]
    assert sorted(r.split(" (")[0] for r in q["reasons"]) == ["false positive: accepts network",
                                                             "false positive: accepts read_hidden"]


def test_the_qa_command_writes_the_report_the_sampler_reads(tmp_path):
    from syncd.app.cli import main

    out = tmp_path / "qa.json"
    assert main(["tasks", "qa", "--count", "1", "--out", str(out), "--strict"]) == 0
    doc = json.loads(out.read_text())
    assert doc["tasks"] == 2 and doc["kept"] == 2 and load_quarantine(out) == {}
    from syncd.app.tasks_cli import main as tasks_main

    buf = io.StringIO()
    assert tasks_main(["show", "bugfix", "0"], out=buf) == 0
    shown = json.loads(buf.getvalue())
    assert shown["id"] == "bugfix-0-0" and "hidden" not in shown and "reference" not in shown
    assert tasks_main(["qa", "--kinds", "nope"]) == 2
