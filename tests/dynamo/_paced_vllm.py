"""A vLLM logits processor that paces generation, so that a test can kill a vLLM worker in the middle of a stream
however busy the machine is: while the file named by ``PACED_VLLM_HOLD`` exists, every sampling step of the vLLM
worker sleeps :data:`PACE_S` first. A stream of ``n`` tokens then lasts at least ``n * PACE_S`` seconds, slower the
busier the machine; nothing else changes (the logits are returned untouched). Removing the file lets vLLM run at
full speed again.

It reaches an unmodified ``--engine vllm`` worker through vLLM's own plugin mechanism: vLLM loads every class
published in the ``vllm.logits_processors`` entry-point group (``vllm/v1/sample/logits_processor/__init__.py``).
:func:`worker_env` writes a distribution's metadata that publishes it and puts it on a worker's ``PYTHONPATH``;
the worker's vLLM loads it in its worker process. Not a mock: a real processor in a real vLLM, used only to slow
it.

Why not a pause, or SIGSTOP: a pause sent to a worker streaming on a busy machine took 17 s to land, and with the
engine processes stopped between short SIGSTOP steps vLLM still made a whole 3000-token stream before the client
had seen 32 tokens in 4 of 14 runs beside busy loops (docs/dynamo.md)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from vllm.v1.sample.logits_processor.interface import BatchUpdate, LogitsProcessor

#: the variable naming the hold file (read in the vLLM worker process)
HOLD_VAR = "PACED_VLLM_HOLD"
#: seconds each sampling step waits while the hold file exists
PACE_S = 0.05


class PacedSteps(LogitsProcessor):
    """Sleeps :data:`PACE_S` in each sampling step while the file ``$PACED_VLLM_HOLD`` exists, and creates
    :func:`paced_marker` the first time it does (a test's proof that vLLM loaded it); the logits pass through
    unchanged. Not argmax-invariant, so vLLM calls it for greedy batches too."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        self.hold = os.environ.get(HOLD_VAR)
        self.marked = False

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.hold and os.path.exists(self.hold):
            if not self.marked:
                paced_marker(self.hold).touch()
                self.marked = True
            time.sleep(PACE_S)
        return logits


def paced_marker(hold) -> Path:
    """The file :class:`PacedSteps` creates beside the hold file ``hold`` once it has paced a step."""
    return Path(f"{hold}.paced")


def worker_env(folder: Path, hold: Path) -> dict:
    """The variables that make a Dynamo ``--engine vllm`` worker load :class:`PacedSteps` (for
    ``NodeConfig.worker_env``): the plugin's metadata written into ``folder`` and put on ``PYTHONPATH`` with this
    repository (where ``tests`` is imported from), and ``hold`` as the hold file. The pace holds while ``hold``
    exists."""
    info = folder / "syncd_test_paced_vllm-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: syncd-test-paced-vllm\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[vllm.logits_processors]\npaced = {__name__}:PacedSteps\n")
    paths = [folder, Path(__file__).resolve().parents[2], os.environ.get("PYTHONPATH")]
    return {HOLD_VAR: str(hold), "PYTHONPATH": os.pathsep.join(str(p) for p in paths if p)}
