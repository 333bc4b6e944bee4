"""Where the step loop (:func:`syncd.trainer.rl.loop.train`) gets step ``N``'s plan: the trajectories it trains, their
rewards and the weight versions their tokens came from (made by the live side, :class:`syncd.trainer.rl.live.LiveSide`).

Both sources have ``get(step) -> plan`` (blocking until the plan exists) and ``committed(step)`` (the step was
trained and committed; called once per committed step, in order).

* :class:`BroadcastPlans`, a plain data-parallel job: rank 0's live side makes the plan (or reads it from the
  recorded plans, offline), every rank receives it (:meth:`syncd.trainer.dist.DataParallel.broadcast_result`).
* :class:`LoggedPlans`, an elastic job: the store's plan log (:class:`syncd.trainer.ft.plan_log.PlanLog`) is the
  source of truth. Group 0 -- the live side -- writes step ``N``'s plan there before anyone trains it (or finds
  it there, written by its earlier life), the other groups read it; with ``--plans`` every group reads the
  recorded plans. A group 0 that restarts behind the others first accounts for the plans they trained while it
  was away (their prompts consumed).

Thread-safety: the training thread only.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)

__all__ = ["BroadcastPlans", "LoggedPlans"]


class BroadcastPlans:
    """A plain job's plans (module docstring). ``dp``: the job's :class:`~syncd.trainer.dist.DataParallel`;
    ``live``: rank 0's live side (None on the other ranks)."""

    def __init__(self, dp, live):
        self.dp, self.live = dp, live

    def get(self, step: int) -> dict:
        """Step ``step``'s plan on every rank; rank 0's failure to make it is raised on every rank."""
        return self.dp.broadcast_result((lambda: self.live.plan(step)) if self.live is not None else None)

    def committed(self, step: int) -> None:
        """Nothing to do: the live side accounts for the step in ``finish_step``."""


class LoggedPlans:
    """An elastic replica group's plans (module docstring). ``cfg``: the run's configuration (``plans``,
    ``rollout_timeout_s``); ``live``: group 0's live side, else None; ``plan_log``: the run's
    :class:`~syncd.trainer.ft.plan_log.PlanLog`; ``start_step``: the step this group restored (the live side's RL
    state includes every plan up to it)."""

    def __init__(self, cfg, live, plan_log, start_step: int):
        self.cfg, self.live, self.log = cfg, live, plan_log
        self.accounted = start_step  # the live side's RL state includes every plan up to here
        self.offline = None
        if cfg.plans:
            self.offline = [json.loads(ln) for ln in Path(cfg.plans).read_text().splitlines() if ln.strip()]

    def get(self, step: int) -> dict:
        if self.offline is not None:
            return self.offline[step - 1]
        if self.live is None:
            return self.log.wait(step, self.cfg.rollout_timeout_s)
        for s in range(self.accounted + 1, step):  # trained by the others while this group was away
            self._adopt(self.log.wait(s, 60), consumed=True)
        self.accounted = max(self.accounted, step - 1)
        plan = self.log.get(step)
        if plan is not None:
            self._adopt(plan, consumed=False)
            return plan
        return self.log.put(step, self.live.plan(step))

    def committed(self, step: int) -> None:
        self.accounted = step

    def _adopt(self, plan: dict, *, consumed: bool) -> None:
        """A plan the live side did not make in this life: its prompts leave the buffer (``consumed``: trained
        already); one still to train is recorded as the live side records its own."""
        indices = [g["item"]["index"] for g in plan["groups"]]
        if self.live.buffer is not None:
            self.live.buffer.remove(indices)
            if consumed:
                self.live.buffer.consume(indices)
        if not consumed:
            self.live.record(plan)
