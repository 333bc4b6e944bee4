"""The thin trainer as an elastic job: one process per replica group on torchft (``syncd.trainer.elastic``).

    torchft_lighthouse --min_replicas 1 --bind HOST:PORT --join_timeout_ms 1000 --heartbeat_timeout_ms 5000
    python -m syncd.trainer.run ... --lighthouse http://HOST:PORT --replica-groups 3 --replica-group I \\
        --min-replicas 2 --checkpoint-dir /local/ckpt --out OUT       # for I = 0, 1, 2; restart a dead one as is

A step: the group fetches step ``N``'s plan (group 0 -- the live side: rollout workers, buffer, publisher --
makes it and writes it to the store's plan log, :mod:`syncd.trainer.plan_log`, before anyone trains it; the others
read it there; with ``--plans`` every group reads the recorded plans), joins the step's quorum (a group behind
the others heals here from a live peer, :class:`syncd.trainer.heal.VerifiedTransport`), trains its share of the plan
(group ``i`` of the plan to participant ``i % n``), sums gradients over the participants, and steps only if
every participant voted the step whole; otherwise it retries the same plan on the next quorum. After a commit it
checkpoints (``--checkpoint-dir``; group 0's checkpoint holds the RL state) and replicates to ``--replicas``
other groups.

A group that dies is restarted with the same command line (by whatever runs the job): it restores its newest
checkpoint (local, else rebuilt from the replicas its peers hold), tells torchft its step, and joins; if the
others went on without it, it heals to their step, and group 0 first accounts for the plans trained while it was
away (their prompts consumed). A dead group 0 pauses the pipeline -- the others wait for the next plan -- but
nobody restarts; the job never restarts as a whole.

Each group writes ``OUT/group-<i>/ft.jsonl``: ``restored`` (step, source), one ``attempt`` line per try of a step
(``step``, ``committed``, ``participants``, ``rank``, ``loss``, ``healed``, ``quorum_s``, ``step_s``), ``end``;
group 0 also the live side's files there.
"""

from __future__ import annotations

import logging
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from syncd.store import Store
from syncd.trainer.checkpoint import capture_rng, restore_rng
from syncd.trainer.dist import make_deterministic, weights_digest
from syncd.trainer.metrics import MetricsLog
from syncd.trainer.objective import LossConfig, policy_gradient_loss
from syncd.trainer.optim import build_optimizer

log = logging.getLogger(__name__)

__all__ = ["run_elastic"]


class _Plans:
    """Step ``N``'s plan for this group: from the recorded plans (offline), from the plan log (followers), or --
    on group 0 -- from the log if an earlier life wrote it, else made by the live side and logged."""

    def __init__(self, cfg, live, plan_log, start_step: int):
        self.cfg, self.live, self.log = cfg, live, plan_log
        self.accounted = start_step  # the live side's RL state includes every plan up to here
        self.offline = None
        if cfg.plans:
            import json

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
        plan = self.log.put(step, self.live.plan(step))
        return plan

    def _adopt(self, plan: dict, *, consumed: bool) -> None:
        indices = [g["item"]["index"] for g in plan["groups"]]
        if self.live.buffer is not None:
            self.live.buffer.remove(indices)
            if consumed:
                self.live.buffer.consume(indices)
        if not consumed and self.live._recorded is not None:
            self.live.record(plan)


def run_elastic(cfg) -> dict:
    """Run replica group ``cfg.replica_group`` of an elastic job until ``cfg.steps`` steps are committed."""
    from syncd.trainer.elastic import ElasticDP
    from syncd.trainer.ft import FaultTolerance, FTConfig
    from syncd.trainer.heal import VerifiedTransport
    from syncd.trainer.live import LiveSide
    from syncd.trainer.loop import _load_model, _sequences
    from syncd.trainer.plan_log import PlanLog
    from syncd.trainer.replicas import ReplicaServer

    group, owner = cfg.replica_group, f"group-{cfg.replica_group}"
    owners = tuple(f"group-{i}" for i in range(cfg.replica_groups))
    out = Path(cfg.out) / owner
    gcfg = replace(cfg, out=str(out))
    make_deterministic(cfg.seed, cfg.threads)
    model = _load_model(cfg, torch.device("cpu"))
    opt = build_optimizer(model, cfg.optimizer, lr=cfg.lr, weight_decay=cfg.weight_decay)
    params = [p for p in model.parameters() if p.requires_grad]
    loss_cfg = LossConfig(cfg.is_cap, cfg.is_band, cfg.is_seq_band, cfg.micro_batch)
    store = Store.open(cfg.store)
    out.mkdir(parents=True, exist_ok=True)
    events = MetricsLog(out / "ft.jsonl")
    ft = live = dp = None
    tmp = None
    try:
        if cfg.checkpoint_dir:
            ft = FaultTolerance(FTConfig(cfg.checkpoint_dir, owner, owners, owners, cfg.store, cfg.run_id,
                                         replicas=min(cfg.replicas, len(owners) - 1), keep=cfg.keep_checkpoints,
                                         host=cfg.ft_host, on_busy=cfg.checkpoint_busy))
            server = ft.server
        else:
            tmp = tempfile.TemporaryDirectory(prefix=f"heal-{owner}-")
            server = ReplicaServer(tmp.name, host=cfg.ft_host)
        restored = ft.restore() if ft is not None else None
        if restored is not None:
            restored.apply(model, opt)
        events.write("restored", step=restored.step if restored else 0,
                     source=None if restored is None else restored.source)
        healed = []

        def state_dict():
            return {"model": model.state_dict(), "optim": opt.state_dict(), "rng": capture_rng()}

        def load_state_dict(sd):
            model.load_state_dict(sd["model"])
            opt.load_state_dict(sd["optim"])
            restore_rng(sd["rng"])
            healed.append(True)

        dp = ElasticDP(group=group, groups=cfg.replica_groups, lighthouse=cfg.lighthouse,
                       min_replicas=cfg.min_replicas, state_dict=state_dict, load_state_dict=load_state_dict,
                       transport=VerifiedTransport(server, owner), timeout_s=cfg.ft_timeout_s, host=cfg.ft_host)
        start = restored.step if restored is not None else 0
        if start:
            dp.set_step(start)
        if group == 0 and not cfg.plans:
            live = LiveSide(gcfg, model, resume_step=start if restored is not None else None,
                            commit_gate=(lambda s: ft.durable(s)) if ft is not None else None)
            live.start(restored.state if restored is not None else None)
        plans = _Plans(gcfg, live, PlanLog(cfg.store, cfg.run_id), start)
        while dp.step < cfg.steps:
            step = dp.step + 1
            plan = plans.get(step)
            t0 = time.perf_counter()
            healed.clear()
            rank, n = dp.begin_step()
            tq = time.perf_counter()
            if dp.step + 1 != step:  # healed to the others' step
                step = dp.step + 1
                if step > cfg.steps:
                    break
                plan = plans.get(step)
            mine = [g for i, g in enumerate(plan["groups"]) if rank >= 0 and i % n == rank]
            seqs, adv = _sequences(gcfg, store, mine, live, model.config.vocab_size)
            normalizer = max(1, sum(g["tokens"] for g in plan["groups"]))
            loss, rec = policy_gradient_loss(model, seqs, adv, normalizer=normalizer, config=loss_cfg) \
                if seqs else (0.0, None)
            dp.all_reduce_grads(params)
            loss = dp.all_reduce_sum([loss])[0]
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)) if cfg.grad_clip > 0 else None
            if ft is not None:
                ft.checkpointer.before_update()
            ok = dp.commit()
            if ok:
                opt.step()
            opt.zero_grad()
            step_s = time.perf_counter() - t0
            events.write("attempt", step=step, committed=ok, participants=n, rank=rank, loss=loss,
                         healed=bool(healed), quorum_s=tq - t0, step_s=step_s)
            if not ok:
                log.warning("%s: step %d not committed (a peer failed); retrying it", owner, step)
                continue
            if ft is not None and cfg.checkpoint_busy == "wait":
                ft.checkpointer.wait_previous()  # a step reported finished is at most one ahead of a restorable one
            if live is not None:
                live.finish_step(step, plan, [rec] if rec is not None else [], loss, grad_norm, step_s, loss_cfg,
                                 participants=n)
                plans.accounted = step
            if ft is not None:
                gated = live is not None and live.published_step == step  # its version waits for this checkpoint
                ft.checkpointer.save(step, model, opt, state=live.snapshot() if live is not None else {"step": step},
                                     wait=gated or step == cfg.steps)
        summary = {"digest": weights_digest(model), "group": group, "steps": dp.step, "quorums": dp.quorums,
                   "failed_commits": dp.failed_commits, "restored_step": start}
        if ft is not None:
            ft.checkpointer.flush()
        if live is not None:
            summary = live.close(summary)
        events.write("end", **summary)
        if cfg.save_weights:
            from safetensors.torch import save_file

            save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()},
                      str(out / "weights.safetensors"))
        return summary
    finally:
        if live is not None:
            live.abort()
        if dp is not None:
            dp.close()
        if ft is not None:
            ft.close()
        elif tmp is not None:
            server.close()
            tmp.cleanup()
        events.close()
