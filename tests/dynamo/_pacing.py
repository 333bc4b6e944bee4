"""Pacing a vLLM worker from a test (the helpers; the processor is ``tests/dynamo/_paced_vllm.py``, which imports vLLM,
so these import without it, as on a machine set up with ``SYNCD_VLLM=off``): :func:`worker_env` makes an unmodified
``--engine vllm`` worker load :class:`tests.dynamo._paced_vllm.PacedSteps` through vLLM's plugin group
``vllm.logits_processors``; while the hold file exists every sampling step sleeps :data:`PACE_S`;
:func:`paced_marker` is the file the processor creates once it has paced a step; :func:`paced_stream` holds a
stream while a test acts on it."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

from syncd.procs import wait_until

#: the variable naming the hold file (read in the vLLM worker process)
HOLD_VAR = "PACED_VLLM_HOLD"
#: seconds each sampling step waits while the hold file exists
PACE_S = 0.05
#: the processor's import name, as vLLM's entry point names it
PROCESSOR = "tests.dynamo._paced_vllm:PacedSteps"


def paced_marker(hold) -> Path:
    """The file the processor creates beside the hold file ``hold`` once it has paced a step."""
    return Path(f"{hold}.paced")


def worker_env(folder: Path, hold: Path) -> dict:
    """The variables that make a Dynamo ``--engine vllm`` worker load the pacing processor (for
    ``NodeConfig.worker_env``): the plugin's metadata written into ``folder`` and put on ``PYTHONPATH`` with this
    repository (where ``tests`` is imported from), and ``hold`` as the hold file. The pace holds while ``hold``
    exists."""
    info = folder / "syncd_test_paced_vllm-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: syncd-test-paced-vllm\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[vllm.logits_processors]\npaced = {PROCESSOR}\n")
    paths = [folder, Path(__file__).resolve().parents[2], os.environ.get("PYTHONPATH")]
    return {HOLD_VAR: str(hold), "PYTHONPATH": os.pathsep.join(str(p) for p in paths if p)}


@contextmanager
def paced_stream(hold: Path, stream, seen, enough: int, result: list):
    """Pace the workers (create ``hold``), start ``stream`` (a thread posting the request; ``result``: what it
    ended with, for the message), wait until the client has ``enough`` (``seen()``), check that vLLM paced, and
    run the block (e.g. kill the worker holding the stream); ``hold`` is removed on leaving, so the workers run at
    full speed again. Raises TimeoutError after 240 s, RuntimeError if the stream ends first, AssertionError if
    vLLM did not load the processor."""
    hold.touch()
    try:
        stream.start()
        wait_until(lambda: seen() >= enough, 240, f"the client to have {enough}", interval_s=0.01,
                   alive=lambda: None if stream.is_alive() else f"the stream ended: {result}")
        assert paced_marker(hold).exists(), "vLLM did not load the pacing processor (its plugin)"
        yield
    finally:
        hold.unlink(missing_ok=True)
