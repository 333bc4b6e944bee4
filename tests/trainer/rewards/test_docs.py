"""The rewards worked example in docs/rewards.md prints exactly the output pasted under it."""

from __future__ import annotations

import contextlib
import io
import pathlib

README = pathlib.Path(__file__).resolve().parents[3] / "docs" / "rewards.md"


def test_worked_example_output_is_current():
    text = README.read_text(encoding="utf-8")
    section = text.split("# Rewards (`syncd.trainer.rewards`)", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    expected = section.split("```text\n", 1)[1].split("```", 1)[0]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), {"__name__": "docs_example"})
    assert out.getvalue() == expected
