"""A training loop's per-step checkpoints: what the step loop (:func:`syncd.trainer.rl.loop.train`) calls around each
committed step, over one owner's :class:`syncd.trainer.ft.fault_tolerance.FaultTolerance`.

    ckpts = StepCheckpoints(ft, ranks=dp)          # a plain data-parallel job: the ranks restore together
    ...                                             # forward, backward, gradients reduced
    ckpts.before_update(); opt.step(); ckpts.committed()
    ckpts.save(step, model, opt, state={...}, must=publish_waits_on_it or last_step)
    summary = ckpts.flush()

``ranks``: the data-parallel group whose ranks must hold the same steps -- a plain job restores the newest step
*every* rank holds, so after each step they agree on the newest step all of them hold (retention keeps it,
:meth:`syncd.trainer.ft.checkpoint.Checkpointer.agree`) and, with ``on_busy="skip"``, skip the same steps -- or None
for an owner that restores alone (a replica group of an elastic job: torchft heals it from a live peer if it is
behind the others). Each ``ranks`` decision is one small all-reduce over the group.

With ``on_busy="wait"`` (the default), :meth:`StepCheckpoints.committed` waits for the previous step's write, so a
step reported finished is at most one ahead of a step a restart can restore. Closing the
:class:`~syncd.trainer.ft.fault_tolerance.FaultTolerance` is its owner's business. Thread-safety: the training thread
only.
"""

from __future__ import annotations

import logging

from syncd.trainer.ft.checkpoint import agreed_step, agreement

log = logging.getLogger(__name__)

__all__ = ["StepCheckpoints"]


class StepCheckpoints:
    """See the module docstring. ``ft``: this owner's fault tolerance; ``ranks``: an object with ``world`` and
    ``all_reduce_sum(values) -> values`` (:class:`syncd.trainer.dist.DataParallel`), or None."""

    def __init__(self, ft, *, ranks=None):
        self.ft, self.ranks = ft, ranks
        self.checkpointer = ft.checkpointer

    def before_update(self) -> None:
        """Before the optimizer step: wait until the previous checkpoint's snapshot holds its tensors."""
        self.checkpointer.before_update()

    def committed(self) -> None:
        """After the optimizer step of a committed step: with ``on_busy="wait"``, wait for the previous step's
        write; with ``ranks``, agree with them on the newest step every one of them holds."""
        if self.checkpointer.on_busy == "wait":
            self.checkpointer.wait_previous()  # past this, every rank's checkpoint of step - 1 is written
        if self.ranks is not None:
            common = agreed_step(self.ranks.all_reduce_sum(agreement(self.checkpointer)), self.ranks.world)
            if common is not None:
                self.checkpointer.agree(common)  # retention keeps a step every rank holds

    def save(self, step: int, model, optimizer, *, state, must: bool) -> bool:
        """Checkpoint ``step`` in the background (False: skipped). ``must``: never skip it (a step a publish waits
        on, the last); with ``ranks`` and ``on_busy="skip"``, every rank skips the same steps (any rank busy:
        skip; any rank's ``must``: none skips), or none could restore them all."""
        skip = None
        if self.ranks is not None and self.checkpointer.on_busy == "skip":
            busy, musts = self.ranks.all_reduce_sum([float(self.checkpointer.busy), float(must)])
            skip, must = busy > 0, musts > 0
        return self.checkpointer.save(step, model, optimizer, state=state, wait=must, skip=skip)

    def flush(self) -> dict:
        """Wait for the checkpoint in flight (one that failed and waits for disk room: at most the publish gate's
        ``gate_timeout_s``); what checkpointing did over the run: ``saved``, ``skipped``, ``failures`` (failed write
        attempts), ``retried`` (written on a retry), ``abandoned`` (failed, then replaced by a newer one),
        ``last_error``, ``stall_s`` seconds the training thread waited, ``durable_step``, ``replica_failures``."""
        if not self.checkpointer.flush(room_timeout=self.ft.cfg.gate_timeout_s):
            log.warning("%s: the last checkpoint is still not written: %s", self.ft.cfg.owner,
                        self.checkpointer.stats.last_error)
        st = self.checkpointer.stats
        replicator = self.ft.replicator
        return {"saved": st.saved, "skipped": st.skipped, "failures": st.failures, "retried": st.retried,
                "abandoned": st.abandoned, "last_error": st.last_error, "stall_s": st.stall_s,
                "durable_step": self.checkpointer.durable_step,
                "replica_failures": replicator.failures if replicator is not None else 0}
