"""Importing syncd and building a model prints none of torchao's import-time warnings (its CUDA libraries that a
CPU-only torch cannot load, torch's pytree deprecation about torchao's enums), whoever imports torchao -- here
transformers, lazily, at the first ``from_pretrained`` of a trainer process; the torchao logger's other records
still pass (``syncd.lazy``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import logging, sys
import syncd.trainer.rl.loop  # as `syncd train` starts: no syncd.lazy.quiet_optional_imports() call
from transformers import AutoModelForCausalLM
AutoModelForCausalLM.from_pretrained(sys.argv[1])
assert "torchao" in sys.modules, "transformers did not import torchao: nothing was tested"
logging.getLogger("torchao").warning("a torchao warning of another kind")
"""


def test_no_import_time_warnings_of_optional_extensions(tmp_path):
    from syncd.engine.reference.make_tiny import write_model

    model = write_model(tmp_path / "tiny", arch="qwen2", seed=1)
    p = subprocess.run([sys.executable, "-c", PROBE, str(model)], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Failed to load" not in p.stderr and "Enum subclass" not in p.stderr, p.stderr[-3000:]
    assert "a torchao warning of another kind" in p.stderr  # only that noise is held back
