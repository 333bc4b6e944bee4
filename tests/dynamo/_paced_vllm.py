"""A vLLM logits processor that paces generation, so that a test can kill a vLLM worker in the middle of a stream
however busy the machine is: while the file named by ``PACED_VLLM_HOLD`` exists, every sampling step of the vLLM
worker sleeps :data:`PACE_S` first. A stream of ``n`` tokens then lasts at least ``n * PACE_S`` seconds, slower the
busier the machine; nothing else changes (the logits are returned untouched). Removing the file lets vLLM run at
full speed again.

It reaches an unmodified ``--engine vllm`` worker through vLLM's own plugin mechanism: vLLM loads every class
published in the ``vllm.logits_processors`` entry-point group (``vllm/v1/sample/logits_processor/__init__.py``).
:func:`tests.dynamo._pacing.worker_env` writes a distribution's metadata that publishes it and puts it on a worker's
``PYTHONPATH``; the worker's vLLM loads it in its worker process. Not a mock: a real processor in a real vLLM, used
only to slow it.

Why not a pause, or SIGSTOP: a pause sent to a worker streaming on a busy machine took 17 s to land, and with the
engine processes stopped between short SIGSTOP steps vLLM still made a whole 3000-token stream before the client had
seen 32 tokens in 4 of 14 runs beside busy loops (docs/dynamo.md)."""

from __future__ import annotations

import os
import time

import torch
from vllm.v1.sample.logits_processor.interface import BatchUpdate, LogitsProcessor

from tests.dynamo._pacing import HOLD_VAR, PACE_S, paced_marker


class PacedSteps(LogitsProcessor):
    """Sleeps :data:`~tests.dynamo._pacing.PACE_S` in each sampling step while the file ``$PACED_VLLM_HOLD``
    exists, and creates :func:`~tests.dynamo._pacing.paced_marker` the first time it does (a test's proof that vLLM
    loaded it); the logits pass through unchanged. Not argmax-invariant, so vLLM calls it for greedy batches too."""

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
