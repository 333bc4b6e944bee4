"""syncd in an existing trainer: a ``transformers.TrainerCallback`` that publishes the weights with
:class:`syncd.trainer.WeightPublisher` every K optimizer steps, for TRL's ``GRPOTrainer`` (or any ``transformers.Trainer``).

    from trl import GRPOConfig, GRPOTrainer
    from syncd.trainer.trl_callback import SyncdPublishCallback

    cb = SyncdPublishCallback("s3://bucket/rl", "run-42", every_k=4)
    GRPOTrainer(model=model, args=GRPOConfig(...), reward_funcs=[...], train_dataset=ds, callbacks=[cb]).train()

Versions: the weights at the start of training are version 0 (``on_train_begin``; the engines start from them),
then one version after every ``every_k``-th optimizer step (``on_step_end`` fires after ``optimizer.step()``
and ``state.global_step += 1``; the gate is ``global_step % every_k == 0``, so versions land on steps K, 2K, ...),
and the final weights at ``on_train_end`` if the last step was not one of those. Only the main process
publishes (``state.is_world_process_zero``). ``published`` lists ``(version, global_step)`` of every committed
version (all of them once training ended).

The publisher snapshots the weights cast to its ``dtype`` (bf16 by default) and uploads in the background; the
engines (and ``syncd.versions.materialize``) get exactly that cast. Under FSDP or DeepSpeed ZeRO-3, ``model`` holds
shards: gather a full state dict first (not covered by the tests; see ``docs/trainer.md``).
"""

from __future__ import annotations

import logging

from transformers import TrainerCallback

from syncd.publish.publisher import WeightPublisher

log = logging.getLogger(__name__)

__all__ = ["SyncdPublishCallback"]


class SyncdPublishCallback(TrainerCallback):
    """See the module docstring. ``publisher``: an existing :class:`WeightPublisher` (else one is made from
    ``store``, ``run_id`` and ``publisher_kwargs``, with ``every_k=1``: the callback decides when)."""

    def __init__(self, store=None, run_id: str | None = None, *, every_k: int = 1,
                 publisher: WeightPublisher | None = None, **publisher_kwargs):
        if every_k < 1:
            raise ValueError(f"every_k must be >= 1, got {every_k}")
        if publisher is None and (store is None or run_id is None):
            raise ValueError("give store and run_id, or a publisher")
        self.every_k = every_k
        self._store, self._run_id, self._kwargs = store, run_id, publisher_kwargs
        self.publisher = publisher
        self._last_step: int | None = None

    @property
    def published(self) -> list[tuple[int, int]]:
        return [] if self.publisher is None else [(s.version, s.step) for s in self.publisher.history]

    def _publish(self, model, step: int) -> None:
        if self.publisher is None:
            self.publisher = WeightPublisher(self._store, self._run_id, every_k=1, **self._kwargs)
        if self.publisher.publish(model, step):
            self._last_step = step
            log.info("publishing the weights of step %d", step)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if state.is_world_process_zero and model is not None and self._last_step is None:
            self._publish(model, state.global_step)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.is_world_process_zero and model is not None and state.global_step % self.every_k == 0 \
                and state.global_step != self._last_step:
            self._publish(model, state.global_step)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if not state.is_world_process_zero:
            return
        if model is not None and state.global_step != self._last_step:
            self._publish(model, state.global_step)
        if self.publisher is not None:
            self.publisher.close()  # waits for the last upload; raises if one failed
