"""``syncd.trainer.loop``: the thin trainer's asynchronous RL loop, built from the package's parts.

Every rank (``syncd.trainer.dist.DataParallel``) holds the model and its optimizer (``syncd.trainer.optim``). Rank 0 also
runs the live side: it publishes the initial weights as version 0 (``syncd.trainer.WeightPublisher``), starts the
rollout workers (``syncd.trainer.rollout_workers``: each task item's prompt ``G`` times through the sandbox proxy in
front of the Dynamo frontend, records back through the store), and fills the rollout buffer
(``syncd.trainer.buffer``, staleness bound ``max_lag``). A step:

1. rank 0 takes ``groups_per_step`` groups within the bound (waiting for them) and makes the step's **plan**:
   the trajectories, their rewards and the weight versions their tokens came from; the plan is recorded
   (``plans.jsonl``) and sent to every rank;
2. each rank takes its share of the groups (group ``i`` to rank ``i % world``), reads their rollouts from the
   store, and accumulates the policy-gradient loss of ``syncd.trainer.objective`` (replayed log-probs, importance
   correction) normalised by the step's global token count;
3. gradients are summed in a fixed order (one flat buffer), clipped by global norm, and every rank steps;
4. every ``every_k`` steps rank 0 publishes a version; the node daemon brings the engines to it while they
   keep generating. The final weights are always published.

Asynchrony: the rollout workers run ``lookahead`` groups ahead of training (default: two steps' worth, one
with ``max_lag = 0``), so generation overlaps the trainer's steps and rollouts may come from older versions (at
most ``max_lag`` behind, else dropped). The default ``max_lag = 2``: a group requested just after version ``v``
is published may still be generated on ``v - 1`` while the daemon applies ``v``, and is trained after ``v + 1``.
``sync=True`` is the baseline: generate a step's groups on the newest version (once the daemon status says
every engine serves it), then train, then publish. ``plans=`` trains offline on the plans an earlier run
recorded: the same rollouts, so the same seed ends with bit-identical weights (deterministic algorithms, fixed
reduction order, fixed thread count; ``syncd.trainer.dist.make_deterministic``).

Outputs in ``out`` (replaced when there from an earlier run): ``metrics.jsonl`` (``syncd.trainer.metrics``), ``plans.jsonl``, ``summary.json``, ``run.png``
(``syncd.trainer.plots``) and, with ``save_weights``, ``weights.safetensors`` (float32).

Fault tolerance (``docs/trainer.md``): with ``checkpoint_dir`` every rank checkpoints every step in the
background (``syncd.trainer.checkpoint``; rank 0's holds the RL state of ``syncd.trainer.live``), replicated to ``replicas``
peers on other nodes (``syncd.trainer.replicas``, ``syncd.trainer.peers``), and publishing waits until a step's checkpoint is durable;
``resume`` continues a killed run from the newest step every rank can restore (local, else peers' replicas).
With ``lighthouse`` the job is elastic (``syncd.trainer.elastic_loop``): one process per replica group, a per-step
quorum on torchft, groups leaving and rejoining without a restart.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from syncd.store import Store
from syncd.trainer.buffer import group_advantages
from syncd.trainer.checkpoint import agreed_step, agreement
from syncd.trainer.compaction import sequence_rewards
from syncd.trainer.dist import DataParallel, make_deterministic, weights_digest
from syncd.trainer.objective import LossConfig, policy_gradient_loss
from syncd.trainer.optim import build_optimizer
from syncd.trainer.rollouts import read_rollouts

log = logging.getLogger(__name__)

__all__ = ["LoopConfig", "ConfigError", "run_loop"]


class ConfigError(ValueError):
    """A configuration the loop cannot run; the message names the flag."""


@dataclass(frozen=True)
class LoopConfig:
    """What :func:`run_loop` runs (``python -m syncd.trainer.run --help`` describes each as its flag)."""

    model: str
    store: str
    run_id: str
    out: str
    proxies: tuple[str, ...] = ()
    task: str = "repeat"
    task_length: int = 8
    reward: str | None = None
    steps: int = 30
    group_size: int = 8
    groups_per_step: int = 4
    every_k: int = 1
    max_lag: int = 2
    lookahead: int | None = None
    workers: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    optimizer: str = "adamw"
    lr: float = 1e-2
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    is_cap: float | None = 2.0
    is_band: tuple | None = None
    is_seq_band: tuple | None = None
    micro_batch: int = 64
    adv_scale: bool = True
    seed: int = 0
    threads: int = 1
    full_every: int = 16
    delta_format: int = 1
    sliced_tensors: str | None = None
    daemon_status: str | None = None
    sync: bool = False
    plans: str | None = None
    save_weights: bool = False
    plot: bool = True
    rollout_timeout_s: float = 300.0
    record_timeout_s: float = 60.0
    request_timeout_s: float = 120.0
    engine_timeout_s: float = 120.0
    checkpoint_dir: str | None = None
    resume: bool = False
    replicas: int = 1
    keep_checkpoints: int = 2
    checkpoint_busy: str = "wait"
    node: str | None = None
    ft_host: str = "127.0.0.1"
    lighthouse: str | None = None
    replica_group: int = 0
    replica_groups: int = 1
    min_replicas: int = 1
    ft_timeout_s: float = 30.0
    curation: object | None = None  # a syncd.trainer.curation.CurationConfig: the difficulty filter on the task sampler

    def check(self) -> None:
        """Raise :class:`ConfigError` naming the flag of the first bad setting."""
        from syncd.trainer.optim import OPTIMIZERS
        from syncd.publish.shard_writer import delta_formats
        from syncd.trainer.tasks import get_task

        rules = [(self.every_k >= 1, "--every-k", f"K must be >= 1, got {self.every_k}"),
                 (self.max_lag >= 0, "--max-lag", f"the staleness bound eta must be >= 0, got {self.max_lag}"),
                 (self.steps >= 1, "--steps", f"must be >= 1, got {self.steps}"),
                 (self.group_size >= 2, "--group-size", f"a group needs >= 2 samples, got {self.group_size}"),
                 (self.groups_per_step >= 1, "--groups-per-step", f"must be >= 1, got {self.groups_per_step}"),
                 (self.lookahead is None or self.lookahead >= self.groups_per_step, "--lookahead",
                  f"must be >= --groups-per-step ({self.groups_per_step}), got {self.lookahead}"),
                 (self.lr > 0, "--lr", f"must be > 0, got {self.lr}"),
                 (self.threads >= 1, "--threads", f"must be >= 1, got {self.threads}"),
                 (self.optimizer in OPTIMIZERS, "--optimizer",
                  f"unknown optimizer {self.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}"),
                 (self.plans is not None or bool(self.proxies), "--proxy",
                  "at least one proxy URL is needed (or --plans to train offline)"),
                 (not self.sync or self.daemon_status is not None, "--daemon-status",
                  "the synchronous baseline (--sync) waits for the engines through the daemon's status file"),
                 (not (self.sync and self.plans), "--sync", "cannot be combined with --plans"),
                 (self.checkpoint_dir is not None or not self.resume, "--resume",
                  "needs --checkpoint-dir (where the run's checkpoints are)"),
                 (self.replicas >= 0, "--replicas", f"must be >= 0, got {self.replicas}"),
                 (self.keep_checkpoints >= 1, "--keep-checkpoints", f"must be >= 1, got {self.keep_checkpoints}"),
                 (self.checkpoint_busy in ("skip", "wait"), "--checkpoint-busy",
                  f"must be skip or wait, got {self.checkpoint_busy!r}"),
                 (self.replica_groups >= 1 and 0 <= self.replica_group < self.replica_groups, "--replica-group",
                  f"must be in [0, --replica-groups={self.replica_groups}), got {self.replica_group}"),
                 (1 <= self.min_replicas <= self.replica_groups, "--min-replicas",
                  f"must be in [1, --replica-groups={self.replica_groups}], got {self.min_replicas}"),
                 (self.lighthouse is None or not self.sync, "--sync", "the elastic job (--lighthouse) runs async"),
                 (self.delta_format in (1, 2), "--delta-format", f"must be 1 or 2, got {self.delta_format!r}")]
        for ok, flag, msg in rules:
            if not ok:
                raise ConfigError(f"{flag}: {msg}")
        try:
            delta_formats(self.delta_format, self.sliced_tensors)
        except ValueError as exc:
            raise ConfigError(f"--sliced-tensors: {exc}") from None
        try:
            get_task(self.task, length=self.task_length)
        except ValueError as exc:
            raise ConfigError(f"--task: {exc}") from None
        try:
            LossConfig(self.is_cap, self.is_band, self.is_seq_band, self.micro_batch)
        except ValueError as exc:
            raise ConfigError(f"--is-cap/--is-band/--is-seq-band/--micro-batch: {exc}") from None
        if not Path(self.model, "config.json").is_file():
            raise ConfigError(f"--model: {self.model} is not a model folder (no config.json)")
        if self.plans is not None:
            try:
                n = sum(1 for ln in Path(self.plans).read_text().splitlines() if ln.strip())
            except OSError as exc:
                raise ConfigError(f"--plans: cannot read {self.plans}: {exc}") from None
            if n < self.steps:
                raise ConfigError(f"--plans: {self.plans} holds {n} steps, --steps asks for {self.steps}")


def _load_model(cfg: LoopConfig, device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32).to(device)
    model.train()
    return model


def run_loop(cfg: LoopConfig) -> dict:
    """Run ``cfg`` on this rank (every rank calls it); returns the summary (rank 0's is complete). Raises
    :class:`ConfigError` for a bad configuration and RuntimeError when the run cannot go on."""
    cfg.check()
    if cfg.lighthouse:
        from syncd.trainer.elastic_loop import run_elastic

        return run_elastic(cfg)
    from syncd.trainer.live import LiveSide

    dp = DataParallel()
    make_deterministic(cfg.seed, cfg.threads)
    model = _load_model(cfg, dp.device)
    opt = build_optimizer(model, cfg.optimizer, lr=cfg.lr, weight_decay=cfg.weight_decay)
    params = [p for p in model.parameters() if p.requires_grad]
    loss_cfg = LossConfig(cfg.is_cap, cfg.is_band, cfg.is_seq_band, cfg.micro_batch)
    store = Store.open(cfg.store)
    live = ft = None
    try:
        ft, restored = _fault_tolerance(cfg, dp, model, opt)
        start = restored.step if restored is not None else 0
        if dp.is_main:
            live = LiveSide(cfg, model, resume_step=start if restored is not None else None,
                            commit_gate=(lambda s: ft.durable(s)) if ft is not None else None)
        _shared(dp, (lambda: live.start(restored.state if restored is not None else None))
                if live is not None else None)
        for step in range(start + 1, cfg.steps + 1):
            plan = _shared(dp, (lambda: live.plan(step)) if live is not None else None)
            t0 = time.perf_counter()
            mine = [g for i, g in enumerate(plan["groups"]) if i % dp.world == dp.rank]
            seqs, adv = _sequences(cfg, store, mine, live, model.config.vocab_size)
            normalizer = max(1, sum(g["tokens"] for g in plan["groups"]))
            loss, rec = policy_gradient_loss(model, seqs, adv, normalizer=normalizer, config=loss_cfg) \
                if seqs else (0.0, None)
            dp.all_reduce_grads(params)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)) if cfg.grad_clip > 0 else None
            if ft is not None:
                ft.checkpointer.before_update()
            opt.step()
            opt.zero_grad()
            if ft is not None and cfg.checkpoint_busy == "wait":
                ft.checkpointer.wait_previous()  # past the all-reduce, every rank's checkpoint of step - 1 is written
            sums = dp.all_reduce_sum([loss, *agreement(ft.checkpointer if ft is not None else None)])
            loss = sums[0]
            if ft is not None and (common := agreed_step(sums[1:], dp.world)) is not None:
                ft.checkpointer.agree(common)  # retention keeps a step every rank holds
            recs = dp.gather(rec)
            train_s = time.perf_counter() - t0
            if live is not None:
                live.finish_step(step, plan, [r for r in recs if r is not None], loss, grad_norm, train_s, loss_cfg)
            if ft is not None:
                gated = live is not None and live.published_step == step  # its version waits for this checkpoint
                skip = None
                if cfg.checkpoint_busy == "skip":  # every rank skips the same steps, or none could restore them all
                    busy, gated_ranks = dp.all_reduce_sum([float(ft.checkpointer.busy), float(gated)])
                    skip, gated = busy > 0, gated_ranks > 0
                ft.checkpointer.save(step, model, opt, state=live.snapshot() if live is not None else None,
                                     wait=gated or step == cfg.steps, skip=skip)
        digests = dp.gather(weights_digest(model))
        summary = {"digest": digests[0] if digests else None,
                   "ranks_agree": None if digests is None else len(set(digests)) == 1}
        if ft is not None:
            ft.checkpointer.flush()
            summary["checkpoints"] = _ckpt_summary(ft)
        if live is not None:
            summary = live.close(summary)
        if dp.is_main and cfg.save_weights:
            from safetensors.torch import save_file

            save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()},
                      str(Path(cfg.out) / "weights.safetensors"))
        return summary
    finally:
        if live is not None:
            live.abort()
        if ft is not None:
            ft.close()
        dp.close()


def _ckpt_summary(ft) -> dict:
    st = ft.checkpointer.stats
    return {"saved": st.saved, "skipped": st.skipped, "failures": st.failures, "stall_s": st.stall_s,
            "durable_step": ft.checkpointer.durable_step,
            "replica_failures": ft.replicator.failures if ft.replicator is not None else 0}


def _fault_tolerance(cfg: LoopConfig, dp: DataParallel, model, opt):
    """``(FaultTolerance or None, restored Checkpoint or None)`` for a plain data-parallel job: every rank's
    checkpoints and replica server; with ``resume``, the newest step every rank can restore, applied."""
    if cfg.checkpoint_dir is None:
        return None, None
    from syncd.trainer.ft import FaultTolerance, FTConfig, agree_step, default_node

    node = cfg.node.replace("{rank}", str(dp.rank)) if cfg.node else default_node()
    nodes = dp.broadcast(dp.gather(node))
    owners = tuple(f"rank-{r}" for r in range(dp.world))
    k = min(cfg.replicas, len(set(nodes)) - 1)
    if k < cfg.replicas and dp.is_main:
        log.warning("--replicas %d: the %d ranks are on %d node(s); keeping %d replica(s) (a replica on the "
                    "owner's own node would not survive the node)", cfg.replicas, dp.world, len(set(nodes)), k)
    ft = FaultTolerance(FTConfig(cfg.checkpoint_dir, owners[dp.rank], owners, tuple(nodes), cfg.store, cfg.run_id,
                                 replicas=k, keep=cfg.keep_checkpoints, host=cfg.ft_host,
                                 on_busy=cfg.checkpoint_busy))
    dp.barrier()  # every replica server announced before anyone asks for its replicas
    if not cfg.resume:
        taken = dp.gather(ft.checkpointer.durable_step is not None)
        if dp.broadcast(any(taken) if dp.is_main else None):
            raise ConfigError(f"--checkpoint-dir: {cfg.checkpoint_dir} holds checkpoints of an earlier run: pass "
                              "--resume to continue it, or use another folder")
        return ft, None
    avail = dp.gather(ft.available())
    step = dp.broadcast(agree_step(avail) if dp.is_main else None)
    if step is None:
        raise ConfigError(f"--resume: no checkpoint step that every rank can restore in {cfg.checkpoint_dir} "
                          "(nor on the peers' replicas)")
    ckpt = ft.restore(step=step)
    ok = dp.gather(ckpt is not None)
    if dp.broadcast(all(ok) if dp.is_main else None) is not True:
        raise RuntimeError(f"a rank could not restore step {step} (see its log)")
    ckpt.apply(model, opt)
    log.warning("rank %d: resumed at step %d", dp.rank, step)
    return ft, ckpt


def _shared(dp: DataParallel, make):
    """``make()`` on rank 0, its result on every rank; an exception there is raised there and, as a
    RuntimeError, on the other ranks (which would otherwise wait for rank 0 forever)."""
    if make is not None:
        try:
            value = {"ok": make()}
        except Exception as exc:  # noqa: BLE001 -- the other ranks must hear of it
            dp.broadcast({"error": f"{type(exc).__name__}: {exc}"})
            raise
        return dp.broadcast(value)["ok"]
    value = dp.broadcast(None)
    if "error" in value:
        raise RuntimeError(f"rank 0 stopped the run: {value['error']}")
    return value["ok"]


def _sequences(cfg: LoopConfig, store, groups: list[dict], live, vocab_size: int):
    """This rank's sequences and their advantages: rank 0 has its live groups in memory, the others (and
    offline runs) read them from the store."""
    seqs, adv = [], []
    for g in groups:
        rollouts = live.rollouts_of(g["gid"]) if live is not None else None
        if rollouts is None:
            ids = [tuple(t) for t in g["trajectories"]]
            rollouts = read_rollouts(store, cfg.run_id, trajectories=ids, vocab_size=vocab_size).rollouts
            if len(rollouts) != len(ids):
                raise RuntimeError(f"group {g['gid']}: {len(rollouts)} of {len(ids)} trajectories in the store")
        for ro in rollouts:
            seqs.extend(ro.sequences)
        # one advantage per sequence: a compacted trajectory's sequences (its summaries too) share its reward's
        adv.append(sequence_rewards(rollouts, group_advantages(g["rewards"], scale=cfg.adv_scale)))
    return seqs, (torch.cat(adv) if adv else torch.zeros(0))
