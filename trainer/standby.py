"""A warm standby for the plain trainer: ``syncd train ... --resume --standby``.

A restarted trainer spends most of its restart before it reads a checkpoint: the process start, the imports (torch,
transformers), building the model and its optimizer, connecting the ranks. A standby does all of that ahead of time,
then holds, and takes the run over when its rank 0 process receives ``SIGUSR1`` -- the supervisor's word that the
run's trainer is gone (a supervisor that saw it die: Kubernetes, Slurm, the benchmark). From there it is a
``--resume``: every rank restores the newest step every rank can load, and the run goes on. While it holds, each
rank reads its newest checkpoint ahead (:mod:`syncd.trainer.ft.prefetch`: verified as a restore verifies it, on a
thread at the lowest CPU priority), so the restore reads nothing from disk when that is still the step agreed.

    syncd train <the run's flags> --resume --standby &      # rank 0 logs "standby: ready (pid P)"
    ...                                                     # the trainer dies
    kill -USR1 P                                            # the standby restores and trains

The supervisor must know the old trainer is dead before it sends the signal: the plain job has no fence against
two trainers of one run (the elastic job's leadership terms are that fence). A standby rank that dies ends the
standby (rank 0 polls the others every second through the process group, and a failed collective raises).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

log = logging.getLogger(__name__)

__all__ = ["arm", "wait_for_takeover"]

_go = threading.Event()
_armed = False


def arm() -> None:
    """Make ``SIGUSR1`` mean "take over" in this process. Call it first thing, from the main thread: until then the
    signal's default action ends the process."""
    global _armed
    signal.signal(signal.SIGUSR1, lambda signum, frame: _go.set())
    _armed = True


def wait_for_takeover(dp, poll_s: float = 1.0) -> float:
    """Hold every rank of ``dp`` (:class:`syncd.trainer.dist.DataParallel`) until rank 0's process has received
    ``SIGUSR1``; returns the seconds held. Rank 0 must have called :func:`arm`. Raises RuntimeError when it has not,
    and whatever the process group raises when a rank is gone."""
    if dp.is_main and not _armed:
        raise RuntimeError("standby: SIGUSR1 is not armed in this process (syncd.trainer.standby.arm)")
    t = time.monotonic()
    if dp.is_main:
        log.warning("standby: ready (pid %d): send SIGUSR1 to take the run over", os.getpid())
    while not dp.broadcast(_go.wait(poll_s) if dp.is_main else None):
        pass
    held = time.monotonic() - t
    if dp.is_main:
        log.warning("standby: taking the run over after %.1f s", held)
    return held
