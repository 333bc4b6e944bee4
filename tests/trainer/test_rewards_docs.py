"""The worked example in docs/rewards.md prints exactly the output pasted under it."""

from __future__ import annotations

import contextlib
import io
import pathlib

import pytest

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "rewards.md"


@pytest.mark.skipif(not DOC.exists(), reason="docs/rewards.md not present")
def test_worked_example_output_is_current():
    text = DOC.read_text(encoding="utf-8")
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    expected = text.split("```text\n", 1)[1].split("```", 1)[0]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(DOC), "exec"), {"__name__": "docs_example"})
    assert out.getvalue() == expected
