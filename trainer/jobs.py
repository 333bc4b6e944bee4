"""A run of the thin trainer: the plain data-parallel job or the elastic job, each the one step loop
(:func:`syncd.trainer.rl.loop.train`) over its own data-parallel object and collaborators.

    summary = run_job(cfg)        # what every rank, or every replica group, of a run calls

**Plain** (:func:`plain_job`): ranks of one ``torch.distributed`` group (:class:`syncd.trainer.dist.DataParallel`).
Rank 0 runs the live side and broadcasts each step's plan (:class:`syncd.trainer.rl.plans.BroadcastPlans`). With
``checkpoint_dir`` every rank checkpoints each step (``rank-<r>``, replicated to peers on other nodes; the job's
replica secret is rank 0's, :mod:`syncd.trainer.ft.replica_secret`, handed to every rank over the process group),
and with ``resume`` the ranks restore the newest step every one of them can actually load (its own checkpoint, else
its peers' replicas; :func:`syncd.trainer.ft.fault_tolerance.restore_together`). Checkpoints of another run in the
folder are refused (exit 2, both run ids named). At a clean end every rank's last checkpoint reaches its holders
before any rank closes its replica server. A failed rank stops the job, which is restarted as a whole.

**Elastic** (``lighthouse``, :func:`elastic_job`): one process per replica group on torchft
(:class:`syncd.trainer.ft.elastic.ElasticDP`), for example

    torchft_lighthouse --min_replicas 1 --bind HOST:PORT --join_timeout_ms 1000 --heartbeat_timeout_ms 5000
    python -m syncd.trainer.run ... --lighthouse http://HOST:PORT --replica-groups 3 --replica-group I \\
        --min-replicas 2 --checkpoint-dir /local/ckpt --out OUT       # for I = 0, 1, 2; restart a dead one as is

(groups on several nodes: the same replica secret on each, ``SYNCD_REPLICA_SECRET_FILE``,
:mod:`syncd.trainer.ft.replica_secret`; a group's own checkpoints of another run are refused, exit 2).

The live side (publishing, the queue feed, the buffer, the plans) runs in the group that leads
(:mod:`syncd.trainer.rl.leadership`): a fresh job's group 0 first; when the leader dies, a group waiting for the next
plan claims the next term once its heartbeat has been silent ``--leader-timeout`` seconds and takes the live side
over from the RL state the leader logged after its last committed step (:class:`syncd.trainer.rl.plans.LoggedPlans`);
a restarted group follows, unless the newest term was its own earlier life's (then it claims the next at once).
Every step's plan is in the store's plan log before anyone trains it (with ``--plans``
every group reads the recorded plans). A group joins each step's quorum (one behind the others heals there from a
live peer, :class:`syncd.trainer.ft.heal.VerifiedTransport`, served from its replica server), trains its share, and
steps only if every participant voted the step whole; otherwise it retries the same plan on the next quorum. After a
commit it checkpoints (``group-<i>``) and replicates to ``--replicas`` other groups. A group that dies is restarted
with the same command line (by whatever runs the job): it restores its newest checkpoint (local, else rebuilt from
the replicas its peers hold), tells torchft its step, and joins; if the others went on without it, it heals to
their step. The job never restarts as a whole, nor when the lighthouse restarts (the groups rejoin it), and no group
is special: the rollout service feeds whichever leads through the store. Each group writes
``OUT/group-<i>/ft.jsonl``: ``restored`` (step, source), one ``attempt`` line per try of a step (``step``,
``committed``, ``participants``, ``rank``, ``loss``, ``healed``, ``quorum_s``, ``step_s``), ``end``; the group that
leads also the live side's files there (``metrics.jsonl``: the steps it led).
"""

from __future__ import annotations

import logging
import tempfile
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import torch

from syncd.trainer.dist import DataParallel, make_deterministic
from syncd.trainer.ft.ckpt_dir import capture_rng, restore_rng
from syncd.trainer.ft.step_checkpoints import StepCheckpoints
from syncd.trainer.optim import build_optimizer
from syncd.trainer.rl.config import ConfigError, LoopConfig
from syncd.trainer.rl.loop import Job, train
from syncd.trainer.rl.metrics import MetricsLog
from syncd.trainer.rl.plans import BroadcastPlans, LoggedPlans

log = logging.getLogger(__name__)

__all__ = ["run_job", "plain_job", "elastic_job"]


def run_job(cfg: LoopConfig) -> dict:
    """Run ``cfg`` in this process (every rank, or every replica group, calls it); returns the summary (that of
    the process running the live side is complete). Raises :class:`ConfigError` for a bad configuration and
    RuntimeError when the run cannot go on."""
    cfg.check()
    assemble = elastic_job if cfg.lighthouse else plain_job
    with assemble(cfg) as job:
        return train(job)


def _load_model(cfg: LoopConfig, device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32).to(device)
    model.train()
    return model


@contextmanager
def plain_job(cfg: LoopConfig) -> Iterator[Job]:
    """This rank's :class:`~syncd.trainer.rl.loop.Job` of a plain data-parallel job (module docstring); everything
    it started is closed on exit."""
    from syncd.trainer.rl.live import LiveSide

    with ExitStack() as stack:
        dp = DataParallel()
        stack.callback(dp.close)
        make_deterministic(cfg.seed, cfg.threads)
        model = _load_model(cfg, dp.device)
        opt = build_optimizer(model, cfg.optimizer, lr=cfg.lr, weight_decay=cfg.weight_decay)
        preloaded = _stand_by(cfg, dp) if cfg.standby else []
        ft, restored = _rank_checkpoints(cfg, dp, model, opt, stack, preloaded)
        start = restored.step if restored is not None else 0
        dp.set_step(start)
        live = None
        if dp.is_main:
            live = LiveSide(cfg, model, resume_step=start if restored is not None else None,
                            commit_gate=ft.durable if ft is not None else None)
            stack.callback(live.abort)
        dp.broadcast_result((lambda: live.start(restored.state if restored is not None else None))
                            if live is not None else None)
        yield Job(cfg, dp, model, opt, BroadcastPlans(dp, live),
                  checkpoints=StepCheckpoints(ft, ranks=dp) if ft is not None else None,
                  weights_file=Path(cfg.out, "weights.safetensors") if dp.is_main else None)


def _stand_by(cfg: LoopConfig, dp: DataParallel):
    """A warm standby's hold (:mod:`syncd.trainer.standby`): until the supervisor's signal, this rank reads each
    newer checkpoint of its own ahead of the restore; those read (:class:`~syncd.trainer.ft.prefetch.Prefetched`,
    newest first)."""
    from syncd.trainer.ft.fault_tolerance import own_dir
    from syncd.trainer.ft.prefetch import CheckpointPrefetch
    from syncd.trainer.standby import wait_for_takeover

    owner = _owner(dp.rank)
    pre = CheckpointPrefetch(own_dir(cfg.checkpoint_dir, owner), owner=owner, run_id=cfg.run_id).start()
    try:
        wait_for_takeover(dp)
    finally:
        got = pre.stop()
    log.warning("rank %d: standby: steps read ahead: %s", dp.rank, [p.step for p in got])
    return got


def _owner(rank: int) -> str:
    """A plain job's checkpoint owner name for ``rank``."""
    return f"rank-{rank}"


def _rank_checkpoints(cfg: LoopConfig, dp: DataParallel, model, opt, stack: ExitStack, preloaded=()):
    """``(FaultTolerance or None, restored Checkpoint or None)`` for a plain data-parallel job: every rank's
    checkpoints and replica server (closed by ``stack``); with ``resume``, the newest step every rank can
    restore, applied (``preloaded``: this rank's checkpoints read ahead by a standby, one used if still current)."""
    if cfg.checkpoint_dir is None:
        return None, None
    from syncd.trainer.ft.fault_tolerance import FaultTolerance, FTConfig, default_node, restore_together

    node = cfg.node.replace("{rank}", str(dp.rank)) if cfg.node else default_node()
    nodes = dp.broadcast(dp.gather(node))
    owners = tuple(_owner(r) for r in range(dp.world))
    k = min(cfg.replicas, len(set(nodes)) - 1)
    if k < cfg.replicas and dp.is_main:
        log.warning("--replicas %d: the %d ranks are on %d node(s); keeping %d replica(s) (a replica on the "
                    "owner's own node would not survive the node)", cfg.replicas, dp.world, len(set(nodes)), k)
    secret, problem = dp.broadcast(_main_secret(cfg) if dp.is_main else None)
    if problem:
        raise ConfigError(problem)
    ft = FaultTolerance(FTConfig(cfg.checkpoint_dir, owners[dp.rank], owners, tuple(nodes), cfg.store, cfg.run_id,
                                 replicas=k, keep=cfg.keep_checkpoints, host=cfg.ft_host,
                                 on_busy=cfg.checkpoint_busy, secret=secret))
    stack.push(_shut_down_in_order(ft, dp))
    dp.barrier()  # every replica server announced before anyone asks for its replicas
    problems = dp.gather(_run_problem(ft))
    problem = dp.broadcast(next((p for p in problems if p), None) if dp.is_main else None)
    if problem:
        raise ConfigError(problem)
    if not cfg.resume:
        taken = dp.gather(ft.checkpointer.durable_step is not None)
        if dp.broadcast(any(taken) if dp.is_main else None):
            raise ConfigError(f"--checkpoint-dir: {cfg.checkpoint_dir} holds checkpoints of an earlier life of run "
                              f"{cfg.run_id}: pass --resume to continue it, or use another folder")
        return ft, None
    ft.preloaded = list(preloaded)
    ckpt = restore_together(ft, dp)
    if ckpt is None:
        raise ConfigError(f"--resume: no checkpoint step that every rank can restore in {cfg.checkpoint_dir} "
                          "(nor on the peers' replicas)")
    ckpt.apply(model, opt)
    log.warning("rank %d: resumed at step %d", dp.rank, ckpt.step)
    return ft, ckpt


def _main_secret(cfg: LoopConfig) -> tuple[str | None, str | None]:
    """``(the job's replica secret, None)``, or ``(None, the reason it is unusable)`` (rank 0 reads it; every
    rank hears either)."""
    from syncd.trainer.ft.replica_secret import job_secret

    try:
        return job_secret(cfg.checkpoint_dir), None
    except ValueError as exc:
        return None, f"--checkpoint-dir: {exc}"


def _run_problem(ft) -> str | None:
    """Why this owner's checkpoint folder cannot serve this run (another run's checkpoints in it), or None."""
    from syncd.trainer.ft.ckpt_format import RunMismatch

    try:
        ft.check_run()
    except RunMismatch as exc:
        return f"--checkpoint-dir: {exc}"
    return None


def _shut_down_in_order(ft, dp):
    """The exit callback of a rank's fault tolerance: on a clean end, its last checkpoint written and offered to
    its holders, then every rank's (a barrier), before its replica server closes -- a rank that closed first
    would refuse the other's last push; after a failure, closed at once."""
    def close(exc_type, exc, tb) -> bool:
        try:
            if exc_type is None:
                if not ft.drain():
                    log.warning("%s: the last checkpoint did not reach every holder", ft.cfg.owner)
                dp.barrier()
        finally:
            ft.close()
        return False

    return close


@contextmanager
def elastic_job(cfg: LoopConfig) -> Iterator[Job]:
    """Replica group ``cfg.replica_group``'s :class:`~syncd.trainer.rl.loop.Job` of an elastic job (module
    docstring); its outputs go to ``OUT/group-<i>``; everything it started is closed on exit."""
    from syncd.trainer.ft.elastic import ElasticDP
    from syncd.trainer.ft.fault_tolerance import FaultTolerance, FTConfig
    from syncd.trainer.ft.heal import VerifiedTransport
    from syncd.trainer.ft.plan_log import PlanLog
    from syncd.trainer.ft.replica_server import ReplicaServer
    from syncd.trainer.rl.live import LiveSide

    group, owner = cfg.replica_group, f"group-{cfg.replica_group}"
    owners = tuple(f"group-{i}" for i in range(cfg.replica_groups))
    out = Path(cfg.out) / owner
    gcfg = replace(cfg, out=str(out))
    make_deterministic(cfg.seed, cfg.threads)
    model = _load_model(cfg, torch.device("cpu"))
    opt = build_optimizer(model, cfg.optimizer, lr=cfg.lr, weight_decay=cfg.weight_decay)
    out.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        attempts = MetricsLog(out / "ft.jsonl")
        stack.callback(attempts.close)
        ft, token = None, _group_token(cfg)
        if cfg.checkpoint_dir:
            ft = FaultTolerance(FTConfig(cfg.checkpoint_dir, owner, owners, owners, cfg.store, cfg.run_id,
                                         replicas=min(cfg.replicas, len(owners) - 1), keep=cfg.keep_checkpoints,
                                         host=cfg.ft_host, on_busy=cfg.checkpoint_busy))
            stack.push(_drain_then_close(ft))
            server, token = ft.server, ft.token
            problem = _run_problem(ft)
            if problem:
                raise ConfigError(problem)
        else:  # no checkpoints: a replica server all the same, to serve the live state a healing peer asks for
            heal_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix=f"heal-{owner}-"))
            server = ReplicaServer(heal_dir, host=cfg.ft_host, token=token, run_id=cfg.run_id)
            stack.callback(server.close)
        restored = ft.restore() if ft is not None else None
        if restored is not None:
            restored.apply(model, opt)
        attempts.write("restored", step=restored.step if restored else 0,
                       source=None if restored is None else restored.source)

        def state_dict():
            return {"model": model.state_dict(), "optim": opt.state_dict(), "rng": capture_rng()}

        def load_state_dict(sd):
            model.load_state_dict(sd["model"])
            opt.load_state_dict(sd["optim"])
            restore_rng(sd["rng"])

        dp = ElasticDP(group=group, groups=cfg.replica_groups, lighthouse=cfg.lighthouse,
                       min_replicas=cfg.min_replicas, state_dict=state_dict, load_state_dict=load_state_dict,
                       transport=VerifiedTransport(server, owner, token=token, run_id=cfg.run_id),
                       timeout_s=cfg.ft_timeout_s, host=cfg.ft_host)
        stack.callback(dp.close)
        start = restored.step if restored is not None else 0
        if start:
            dp.set_step(start)
        lead = states = None
        if not cfg.plans:
            from syncd.trainer.ft.plan_log import LiveStateLog
            from syncd.trainer.rl.leadership import Leadership

            lead = Leadership(cfg.store, cfg.run_id, group, timeout_s=cfg.leader_timeout_s)
            stack.callback(lead.close)
            states = LiveStateLog(cfg.store, cfg.run_id)

        def commit_gate(step: int) -> None:  # the checkpoint on the holders, then this group still leads
            if ft is not None:
                ft.durable(step)
            lead.fence()

        def make_live(state_step: int, state: dict | None, settled: list) -> LiveSide:
            live = LiveSide(gcfg, model, resume_step=state_step if state is not None else None,
                            commit_gate=commit_gate)
            stack.callback(live.abort)
            live.start(state, settled)
            return live

        plans = LoggedPlans(gcfg, PlanLog(cfg.store, cfg.run_id), start, lead=lead, states=states,
                            make_live=make_live)
        if lead is not None and lead.may_claim_at_start() and lead.claim():
            plans.take_over(start + 1)
        yield Job(gcfg, dp, model, opt, plans, checkpoints=StepCheckpoints(ft) if ft is not None else None,
                  attempts=attempts, weights_file=out / "weights.safetensors")


def _group_token(cfg: LoopConfig) -> str | None:
    """A replica group's token for live healing without checkpoints: from ``SYNCD_REPLICA_SECRET_FILE`` when set
    (else None: the live state is served unauthenticated, with a warning). With checkpoints, the group's
    :class:`~syncd.trainer.ft.fault_tolerance.FaultTolerance` has it."""
    import os

    from syncd.trainer.ft.replica_secret import ENV_SECRET_FILE, job_secret
    from syncd.trainer.ft.replica_wire import replica_token

    if cfg.checkpoint_dir:
        return None
    if not os.environ.get(ENV_SECRET_FILE):
        log.warning("group %d: live healing without the job's replica token (no --checkpoint-dir, no %s)",
                    cfg.replica_group, ENV_SECRET_FILE)
        return None
    try:
        return replica_token(job_secret(None), cfg.run_id)
    except ValueError as exc:
        raise ConfigError(f"{ENV_SECRET_FILE}: {exc}") from None


def _drain_then_close(ft):
    """A replica group's exit callback: on a clean end its last checkpoint is offered to its holders first."""
    def close(exc_type, exc, tb) -> bool:
        try:
            if exc_type is None and not ft.drain():
                log.warning("%s: the last checkpoint did not reach every holder", ft.cfg.owner)
        finally:
            ft.close()
        return False

    return close
