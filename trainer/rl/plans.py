"""Where the step loop (:func:`syncd.trainer.rl.loop.train`) gets step ``N``'s plan: the trajectories it trains, their
rewards and the weight versions their tokens came from (made by the live side, :class:`syncd.trainer.rl.live.LiveSide`).

Both sources have ``get(step) -> plan`` (blocking until the plan exists) and ``committed(step, state)`` (the step
was trained and committed, ``state`` the live side's RL state of that boundary where this process runs it; called
once per committed step, in order).

* :class:`BroadcastPlans`, a plain data-parallel job: rank 0's live side makes the plan (or reads it from the
  recorded plans, offline), every rank receives it (:meth:`syncd.trainer.dist.DataParallel.broadcast_result`).
* :class:`LoggedPlans`, an elastic job: the store's plan log (:class:`syncd.trainer.ft.plan_log.PlanLog`) is the
  source of truth. The group that leads (:mod:`syncd.trainer.rl.leadership`: a fresh job's group 0, later whoever
  claims the next term) runs the live side and writes step ``N``'s plan there before anyone trains it (or finds it
  there, written by an earlier leader); the others read it. After each committed step the leader logs its RL state
  (:class:`syncd.trainer.ft.plan_log.LiveStateLog`). A follower waiting for a plan whose leader is gone claims the
  next term and takes the live side over: from the newest logged RL state, with the plans trained after it
  accounted for (their prompts consumed) before its queue feed reads anything. With ``--plans`` every group reads
  the recorded plans.

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

    wants_state = False  # committed() does nothing with the RL state

    def __init__(self, dp, live):
        self.dp, self.live = dp, live

    def get(self, step: int) -> dict:
        """Step ``step``'s plan on every rank; rank 0's failure to make it is raised on every rank."""
        return self.dp.broadcast_result((lambda: self.live.plan(step)) if self.live is not None else None)

    def committed(self, step: int, state: dict | None = None) -> None:
        """Nothing to do: the live side accounts for the step in ``finish_step``."""


class LoggedPlans:
    """An elastic replica group's plans (module docstring). ``cfg``: the run's configuration (``plans``,
    ``rollout_timeout_s``); ``plan_log``: the run's :class:`~syncd.trainer.ft.plan_log.PlanLog`; ``start_step``: the
    step this group restored. Live (no ``--plans``): ``lead``, this group's
    :class:`~syncd.trainer.rl.leadership.Leadership`; ``states``, the run's
    :class:`~syncd.trainer.ft.plan_log.LiveStateLog`; ``make_live(state_step, state, settled)``, a started live side
    from a logged RL state (None: a fresh run) with the plans trained after it (``settled``) accounted for.
    :attr:`live` is this group's live side while it leads, else None."""

    def __init__(self, cfg, plan_log, start_step: int, *, lead=None, states=None, make_live=None):
        self.cfg, self.log, self.lead, self.states, self.make_live = cfg, plan_log, lead, states, make_live
        self.live = None
        self.accounted = start_step  # with a live side: every plan up to here is in its RL state
        self.offline = None
        if cfg.plans:
            self.offline = [json.loads(ln) for ln in Path(cfg.plans).read_text().splitlines() if ln.strip()]

    def take_over(self, step: int) -> None:
        """Start this group's live side to make step ``step``'s plan: from the newest logged RL state before it
        and the plans logged after that state (trained by the groups meanwhile)."""
        got = self.states.newest(step - 1)
        if got is None and step > 1:
            raise RuntimeError(f"step {step}: no live state of an earlier step in the store to take the live side "
                               "over from")
        state_step, state = got if got is not None else (0, None)
        settled = [self.log.wait(s, 60) for s in range(state_step + 1, step)]
        self.live = self.make_live(state_step, state, settled)
        self.accounted = step - 1
        if state is None:
            log.warning("group %d starts the live side (a fresh run)", self.lead.group)
        else:
            log.warning("group %d took the live side over at step %d, from the RL state of step %d and %d plan(s) "
                        "after it", self.lead.group, step, state_step, len(settled))

    def get(self, step: int) -> dict:
        if self.offline is not None:
            return self.offline[step - 1]
        if self.live is None:
            plan = self._follow(step)
            if plan is not None:
                return plan
        self.lead.check()
        for s in range(self.accounted + 1, step):  # trained by the others while this group was away
            self._adopt(self.log.wait(s, 60), consumed=True)
        self.accounted = max(self.accounted, step - 1)
        plan = self.log.get(step)
        if plan is not None:
            self._adopt(plan, consumed=False)
            return plan
        return self.log.put(step, self.live.plan(step))

    def _follow(self, step: int) -> dict | None:
        """Step ``step``'s plan from the log; None once this group took the live side over (its leader gone)."""
        lead = self.lead
        patience = self.cfg.rollout_timeout_s + (lead.timeout_s if lead is not None else 0)
        plan = self.log.wait(step, patience, until=None if lead is None else
                             lambda: lead.leader_gone() and lead.claim())
        if plan is None:
            self.take_over(step)
        return plan

    @property
    def wants_state(self) -> bool:
        """Whether :meth:`committed` logs the RL state (this group leads)."""
        return self.live is not None and self.states is not None

    def committed(self, step: int, state: dict | None = None) -> None:
        """The step committed; the leader logs its RL state ``state`` (its live side's snapshot of this boundary:
        another group takes over from it) and stops if it was deposed meanwhile."""
        self.accounted = step
        if self.live is not None and self.states is not None:
            self.lead.check()
            self.states.put(step, state if state is not None else self.live.snapshot())
            if step % 8 == 0:
                self.states.prune(step - 4)

    def _adopt(self, plan: dict, *, consumed: bool) -> None:
        self.live.adopt(plan, consumed=consumed)
