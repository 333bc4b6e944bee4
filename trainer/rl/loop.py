"""The thin trainer's asynchronous RL step loop, :func:`train`, written once for every kind of job.

Every rank (or replica group) holds the model and its optimizer (``syncd.trainer.optim``). The process that runs
the live side (:class:`syncd.trainer.rl.live.LiveSide`: rank 0, or the leading replica group) publishes the initial weights as
version 0 (``syncd.trainer.WeightPublisher``), starts the rollout workers (``syncd.trainer.rl.rollout_workers``:
each task item's prompt ``G`` times through the sandbox proxy in front of the Dynamo frontend, records back through
the store), and fills the rollout buffer (``syncd.trainer.rl.buffer``, staleness bound ``max_lag``, its buffer policy
``syncd.trainer.rl.buffer_policy``: what a step takes, what is dropped and why, in the step's metrics line). A step:

1. the live side takes ``groups_per_step`` groups within the bound (waiting for them) and makes the step's
   **plan**: the trajectories, their rewards and the weight versions their tokens came from; the plan is recorded
   (``plans.jsonl``) and reaches every process (``syncd.trainer.rl.plans``);
2. each process takes its share of the groups (group ``i`` to participant ``i % n``), reads their rollouts from
   the store (kept sets recorded to be rebuilt are rebuilt from the versions that sampled them,
   ``syncd.trainer.rl.kept_resolver``), and accumulates the policy-gradient loss of ``syncd.trainer.rl.objective`` (replayed log-probs,
   importance correction) normalised by the step's global token count;
3. gradients are summed in a fixed order (one flat buffer), clipped by global norm, and every participant steps
   once the step is committed;
4. every ``every_k`` steps the live side publishes a version; the node daemon brings the engines to it while they
   keep generating. The final weights are always published.

Asynchrony: the rollout workers run ``lookahead`` groups ahead of training (default: two steps' worth, one
with ``max_lag = 0``), so generation overlaps the trainer's steps and rollouts may come from older versions (at
most ``max_lag`` behind, else dropped). The default ``max_lag = 2``: a group requested just after version ``v``
is published may still be generated on ``v - 1`` while the daemon applies ``v``, and is trained after ``v + 1``.
``sync=True`` is the baseline: generate a step's groups on the newest version (once the daemon status says
every engine serves it), then train, then publish. ``plans=`` trains offline on the plans an earlier run
recorded: the same rollouts, so the same seed ends with bit-identical weights (deterministic algorithms, fixed
reduction order, fixed thread count; ``syncd.trainer.dist.make_deterministic``).

Outputs in ``out`` (replaced when there from an earlier run): ``metrics.jsonl`` (``syncd.trainer.rl.metrics``),
``plans.jsonl``, ``summary.json``, ``run.png`` (``syncd.trainer.rl.plots``) and, with ``save_weights``,
``weights.safetensors`` (float32).

The loop runs over a data-parallel object and the collaborators of a :class:`Job`, assembled by
:mod:`syncd.trainer.jobs` -- as torchft's ``OptimizerWrapper`` hides elasticity from a plain loop:

* ``dp.begin_step()`` gives this process's share of the next step (``(rank, n)``); the elastic
  :class:`syncd.trainer.ft.elastic.ElasticDP` joins the step's quorum there, and a group behind the others heals
  there (``dp.step`` moves on: the loop then trains the others' step);
* ``dp.commit()`` after the gradients are summed: always True for :class:`syncd.trainer.dist.DataParallel`;
  torchft's ``should_commit`` for the elastic one (False: a peer failed; the optimizer does not step and the same
  step is tried again on the next quorum);
* the plan source (broadcast from rank 0, or the elastic job's plan log), the checkpoints
  (:class:`syncd.trainer.ft.step_checkpoints.StepCheckpoints`, ``docs/trainer.md``: every step in the background,
  replicated to peers on other nodes, publishing gated on a step's checkpoint being durable) and the attempt log
  (an elastic group's ``ft.jsonl``: one ``attempt`` line per try of a step, ``end``) are handed in.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from syncd.store import Store
from syncd.trainer.rl.buffer import group_advantages
from syncd.trainer.rl.compaction import sequence_rewards
from syncd.trainer.rl.config import LoopConfig
from syncd.trainer.rl.kept_resolver import KeptResolver
from syncd.trainer.rl.objective import LossConfig, policy_gradient_loss
from syncd.trainer.rl.rollouts import read_rollouts

log = logging.getLogger(__name__)

__all__ = ["Job", "train"]


@dataclass
class Job:
    """What :func:`train` runs on; the job that assembled it owns (and closes) every part.

    ``cfg``: the run's configuration (``cfg.out``: this process's output folder). ``dp``: the data-parallel object
    (:class:`syncd.trainer.dist.DataParallel` or :class:`syncd.trainer.ft.elastic.ElasticDP`: ``step``,
    ``begin_step()``, ``all_reduce_grads``, ``all_reduce_sum``, ``commit()``, ``healed``, ``gather``,
    ``summary``). ``model``, ``opt``: this process's model and optimizer. ``plans``: the plan source
    (:mod:`syncd.trainer.rl.plans`; its ``live`` is the live side while this process runs it,
    :class:`syncd.trainer.rl.live.LiveSide`, else None: in an elastic job it moves between groups). ``checkpoints``:
    :class:`syncd.trainer.ft.step_checkpoints.StepCheckpoints` (None: no checkpoints). ``attempts``: a
    :class:`syncd.trainer.rl.metrics.MetricsLog` for one ``attempt`` line per try of a step and the ``end`` line (None:
    none). ``weights_file``: where this process writes its final weights with ``cfg.save_weights`` (None: another
    process does)."""

    cfg: LoopConfig
    dp: object
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    plans: object
    checkpoints: object | None = None
    attempts: object | None = None
    weights_file: Path | None = None


def train(job: Job) -> dict:
    """Train until ``job.dp.step`` reaches ``cfg.steps`` committed steps; returns the summary (the live side's,
    where this process runs it, is complete). Raises RuntimeError when the run cannot go on (no rollouts, a
    missing trajectory, another rank stopped the run)."""
    cfg, dp, model, opt, ckpts = job.cfg, job.dp, job.model, job.opt, job.checkpoints
    params = [p for p in model.parameters() if p.requires_grad]
    loss_cfg = LossConfig(cfg.is_cap, cfg.is_band, cfg.is_seq_band, cfg.micro_batch)
    store = Store.open(cfg.store)
    resolver = KeptResolver(model, store, cfg.run_id)
    while dp.step < cfg.steps:
        step = dp.step + 1
        plan = job.plans.get(step)
        t0 = time.perf_counter()
        rank, n = dp.begin_step()
        tq = time.perf_counter()
        if dp.step + 1 != step:  # healed to the others' step
            step = dp.step + 1
            if step > cfg.steps:
                break
            plan = job.plans.get(step)
        live = job.plans.live  # after get(): this group may have just taken the live side over
        mine = [g for i, g in enumerate(plan["groups"]) if rank >= 0 and i % n == rank]
        seqs, adv = _sequences(cfg, store, mine, live, model.config.vocab_size, resolver)
        normalizer = max(1, sum(g["tokens"] for g in plan["groups"]))
        loss, rec = policy_gradient_loss(model, seqs, adv, normalizer=normalizer, config=loss_cfg) \
            if seqs else (0.0, None)
        dp.all_reduce_grads(params)
        loss = dp.all_reduce_sum([loss])[0]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)) if cfg.grad_clip > 0 else None
        if ckpts is not None:
            ckpts.before_update()
        ok = dp.commit()
        if ok:
            opt.step()
        opt.zero_grad()
        if job.attempts is not None:
            job.attempts.write("attempt", step=step, committed=ok, participants=n, rank=rank, loss=loss,
                               healed=dp.healed, quorum_s=tq - t0, step_s=time.perf_counter() - t0)
        if not ok:
            log.warning("step %d not committed (a peer failed); retrying it", step)
            continue
        if ckpts is not None:
            ckpts.committed()
        recs = dp.gather(rec)
        train_s = time.perf_counter() - t0
        if live is not None:
            live.finish_step(step, plan, [r for r in recs if r is not None], loss, grad_norm, train_s, loss_cfg,
                             participants=n, **_buffer_policy(live))
        # the RL state of this boundary, taken once for the checkpoint and the plan source that logs it
        state = live.snapshot() if live is not None and (ckpts is not None or job.plans.wants_state) else None
        job.plans.committed(step, state)
        if ckpts is not None:
            gated = live is not None and live.published_step == step  # its version waits for this checkpoint
            ckpts.save(step, model, opt, state=state if state is not None else {"step": step},
                       must=gated or step == cfg.steps)
    live = job.plans.live
    summary = dp.summary(model)
    if ckpts is not None:
        summary["checkpoints"] = ckpts.flush()
    if live is not None:
        summary = live.close(summary)
    if job.attempts is not None:
        job.attempts.write("end", **summary)
    if cfg.save_weights and job.weights_file is not None:
        from safetensors.torch import save_file

        save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, str(job.weights_file))
    return summary


def _buffer_policy(live) -> dict:
    """The step line's view of the rollout buffer's policy (``syncd.trainer.rl.buffer_policy``): drops by reason
    (``buffer_dropped``) and ``buffer_policy`` (quota waits and overrides, target shares, the trained window's mix)."""
    buffer = getattr(live, "buffer", None)
    if buffer is None:
        return {}
    stats = buffer.stats()
    return {"buffer_dropped": stats["dropped"], "buffer_policy": stats["policy"]}


def _sequences(cfg: LoopConfig, store, groups: list[dict], live, vocab_size: int, resolver: KeptResolver):
    """This process's sequences and their advantages: the live side has its groups in memory (their kept sets
    resolved when they were read), the other ranks (and offline runs) read them from the store and resolve the kept
    sets recorded to be rebuilt (:mod:`syncd.trainer.rl.kept_resolver`)."""
    seqs, adv = [], []
    for g in groups:
        rollouts = live.rollouts_of(g["gid"]) if live is not None else None
        if rollouts is None:
            ids = [tuple(t) for t in g["trajectories"]]
            rollouts = read_rollouts(store, cfg.run_id, trajectories=ids, vocab_size=vocab_size).rollouts
            if len(rollouts) != len(ids):
                raise RuntimeError(f"group {g['gid']}: {len(rollouts)} of {len(ids)} trajectories in the store")
            rollouts = resolver.rollouts(rollouts)
        for ro in rollouts:
            seqs.extend(ro.sequences)
        # one advantage per sequence: a compacted trajectory's sequences (its summaries too) share its reward's
        adv.append(sequence_rewards(rollouts, group_advantages(g["rewards"], scale=cfg.adv_scale)))
    return seqs, (torch.cat(adv) if adv else torch.zeros(0))
