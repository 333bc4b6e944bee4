"""Running a benchmark's ``main`` in a test: it must exit 0 and write its JSON."""

from __future__ import annotations

import json


def run_bench(module, args: list[str], tmp_path, capsys) -> tuple[dict, str]:
    """``module.main(args)`` with ``--json`` into ``tmp_path``, which must return 0: ``(the JSON it wrote, what it
    printed)``."""
    out = tmp_path / f"{module.__name__.rsplit('.', 1)[-1]}.json"
    assert module.main([*args, "--json", str(out)]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out
