"""``trainer.loop``: the thin trainer's asynchronous RL loop, built from the package's parts.

Every rank (``trainer.dist.DataParallel``) holds the model and its optimizer (``trainer.optim``). Rank 0 also
runs the live side: it publishes the initial weights as version 0 (``trainer.WeightPublisher``), starts the
rollout workers (``trainer.rollout_workers``: each task item's prompt ``G`` times through the sandbox proxy in
front of the Dynamo frontend, records back through the store), and fills the rollout buffer
(``trainer.buffer``, staleness bound ``max_lag``). A step:

1. rank 0 takes ``groups_per_step`` groups within the bound (waiting for them) and makes the step's **plan**:
   the trajectories, their rewards and the weight versions their tokens came from; the plan is recorded
   (``plans.jsonl``) and sent to every rank;
2. each rank takes its share of the groups (group ``i`` to rank ``i % world``), reads their rollouts from the
   store, and accumulates the policy-gradient loss of ``trainer.objective`` (replayed log-probs, importance
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
reduction order, fixed thread count; ``trainer.dist.make_deterministic``).

Outputs in ``out`` (replaced when there from an earlier run): ``metrics.jsonl`` (``trainer.metrics``), ``plans.jsonl``, ``summary.json``, ``run.png``
(``trainer.plots``) and, with ``save_weights``, ``weights.safetensors`` (float32).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from syncd.store import Store
from trainer.buffer import BufferClosed, RolloutBuffer, group_advantages
from trainer.compaction import sequence_rewards
from trainer.dist import DataParallel, make_deterministic, weights_digest
from trainer.metrics import EngineWatcher, MetricsLog, read_metrics, summarize
from trainer.objective import LossConfig, TokenRecord, policy_gradient_loss, step_diagnostics
from trainer.optim import build_optimizer
from trainer.rollouts import read_rollouts

log = logging.getLogger(__name__)

__all__ = ["LoopConfig", "ConfigError", "run_loop"]


class ConfigError(ValueError):
    """A configuration the loop cannot run; the message names the flag."""


@dataclass(frozen=True)
class LoopConfig:
    """What :func:`run_loop` runs (``python -m trainer.run --help`` describes each as its flag)."""

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
    daemon_status: str | None = None
    sync: bool = False
    plans: str | None = None
    save_weights: bool = False
    plot: bool = True
    rollout_timeout_s: float = 300.0
    record_timeout_s: float = 60.0
    request_timeout_s: float = 120.0
    engine_timeout_s: float = 120.0
    curation: object | None = None  # a trainer.curation.CurationConfig: the difficulty filter on the task sampler

    def check(self) -> None:
        """Raise :class:`ConfigError` naming the flag of the first bad setting."""
        from trainer.optim import OPTIMIZERS
        from trainer.tasks import get_task

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
                 (not (self.sync and self.plans), "--sync", "cannot be combined with --plans")]
        for ok, flag, msg in rules:
            if not ok:
                raise ConfigError(f"{flag}: {msg}")
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
    dp = DataParallel()
    make_deterministic(cfg.seed, cfg.threads)
    model = _load_model(cfg, dp.device)
    opt = build_optimizer(model, cfg.optimizer, lr=cfg.lr, weight_decay=cfg.weight_decay)
    params = [p for p in model.parameters() if p.requires_grad]
    loss_cfg = LossConfig(cfg.is_cap, cfg.is_band, cfg.is_seq_band, cfg.micro_batch)
    store = Store.open(cfg.store)
    live = _Live(cfg, model) if dp.is_main else None
    try:
        _shared(dp, live.start if live is not None else None)
        for step in range(1, cfg.steps + 1):
            plan = _shared(dp, (lambda: live.plan(step)) if live is not None else None)
            t0 = time.perf_counter()
            mine = [g for i, g in enumerate(plan["groups"]) if i % dp.world == dp.rank]
            seqs, adv = _sequences(cfg, store, mine, live, model.config.vocab_size)
            normalizer = max(1, sum(g["tokens"] for g in plan["groups"]))
            loss, rec = policy_gradient_loss(model, seqs, adv, normalizer=normalizer, config=loss_cfg) \
                if seqs else (0.0, None)
            dp.all_reduce_grads(params)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)) if cfg.grad_clip > 0 else None
            opt.step()
            opt.zero_grad()
            loss = dp.all_reduce_sum([loss])[0]
            recs = dp.gather(rec)
            train_s = time.perf_counter() - t0
            if live is not None:
                live.finish_step(step, plan, [r for r in recs if r is not None], loss, grad_norm, train_s, loss_cfg)
        digests = dp.gather(weights_digest(model))
        summary = {"digest": digests[0] if digests else None,
                   "ranks_agree": None if digests is None else len(set(digests)) == 1}
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
        dp.close()


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


class _Live:
    """Rank 0's side of the loop: publishing, rollout workers, buffer, plans and metrics."""

    def __init__(self, cfg: LoopConfig, model):
        self.cfg, self.model = cfg, model
        out = Path(cfg.out)
        out.mkdir(parents=True, exist_ok=True)
        self.metrics = MetricsLog(out / "metrics.jsonl", truncate=True)
        self.version, self.step = 0, 0
        self.pub = self.workers = self.watcher = self.buffer = None
        self._recorded = None if cfg.plans else open(out / "plans.jsonl", "w")
        self._plans = None
        self._live_groups: dict[int, list] = {}
        self._last = (time.time(), 0)
        self.curated = None

    def start(self) -> None:
        cfg = self.cfg
        self.metrics.write("start", config={k: v for k, v in asdict(cfg).items()})
        if cfg.daemon_status:
            self.watcher = EngineWatcher(cfg.daemon_status, self.metrics).start()
        if cfg.plans:
            self._plans = [json.loads(ln) for ln in Path(cfg.plans).read_text().splitlines() if ln.strip()]
            return
        from syncd.versions import has_versions
        from trainer.publisher import WeightPublisher
        from trainer.rollout_workers import ProxyError, RolloutWorkers, Sampling, proxy_models
        from trainer.tasks import get_task, load_reward

        try:
            names = [proxy_models(u) for u in cfg.proxies]
        except ProxyError as exc:
            raise ConfigError(f"--proxy: no engines reachable: {exc}") from None
        if has_versions(cfg.store, cfg.run_id):
            raise ConfigError(f"--run-id: run {cfg.run_id} already has versions in {cfg.store}; the engines start "
                              "from version 0: use a new run id")
        task = get_task(cfg.task, length=cfg.task_length)
        reward = load_reward(cfg.reward) if cfg.reward else task.reward
        if cfg.curation is not None:
            from trainer.curation import CuratedTask

            task = self.curated = CuratedTask(task, cfg.curation)
            reward = task.observing(reward)
        self.pub = WeightPublisher(cfg.store, cfg.run_id, every_k=1, full_every=cfg.full_every)
        self.pub.publish_model_files(cfg.model)  # config + tokenizer: `syncd materialize` needs no --config-from
        self._publish(0)
        self.buffer = RolloutBuffer(0 if cfg.sync else cfg.max_lag, on_drop=lambda n: self.workers.allow(n))
        self.workers = RolloutWorkers(
            proxies=list(cfg.proxies), model_name=names[0][0], task=task, reward=reward, group_size=cfg.group_size,
            sampling=Sampling(cfg.temperature, cfg.top_p, cfg.top_k), store=cfg.store, run_id=cfg.run_id,
            buffer=self.buffer, version=lambda: self.version, step=lambda: self.step,
            workers=cfg.workers or cfg.groups_per_step, seed=cfg.seed, vocab_size=self.model.config.vocab_size,
            request_timeout_s=cfg.request_timeout_s, record_timeout_s=cfg.record_timeout_s).start()
        if not cfg.sync:
            self.workers.allow(cfg.lookahead or cfg.groups_per_step * (1 + min(cfg.max_lag, 1)))

    def _publish(self, step: int) -> None:
        t = time.time()
        stall = time.perf_counter()
        self.pub.publish(self.model, step)
        self.version = 0 if step == 0 else self.version + 1
        self.metrics.write("publish", version=self.version, step=step, stall_s=time.perf_counter() - stall, t=t)

    def plan(self, step: int) -> dict:
        self.step = step
        if self._plans is not None:
            return self._plans[step - 1]
        cfg, t0 = self.cfg, time.perf_counter()
        if cfg.sync:
            self._wait_engines(self.version)
            self.workers.allow(cfg.groups_per_step)
        try:
            groups = self.buffer.take(cfg.groups_per_step, self.version, timeout_s=cfg.rollout_timeout_s)
        except (TimeoutError, BufferClosed) as exc:
            raise RuntimeError(f"no rollouts: {exc}; rollout workers: {self.workers.stats()}") from None
        if not cfg.sync:
            self.workers.allow(cfg.groups_per_step)
        for g in groups:
            self._live_groups[g.gid] = g.rollouts
        plan = {"kind": "plan", "step": step, "version": self.version, "wait_s": time.perf_counter() - t0,
                "groups": [g.plan() for g in groups]}
        self._recorded.write(json.dumps(plan) + "\n")
        self._recorded.flush()
        return plan

    def _wait_engines(self, version: int) -> None:
        deadline = time.monotonic() + self.cfg.engine_timeout_s
        while True:
            self.watcher.poll()
            at = self.watcher.min_version()
            if at is not None and at >= version:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engines did not reach version {version} within {self.cfg.engine_timeout_s}"
                                   f" s (daemon status {self.cfg.daemon_status}: {self.watcher.versions})")
            time.sleep(0.05)

    def rollouts_of(self, gid: int):
        return self._live_groups.pop(gid, None)

    def finish_step(self, step: int, plan: dict, recs: list, loss: float, grad_norm, train_s: float,
                    loss_cfg: LossConfig) -> None:
        cfg = self.cfg
        if self.pub is not None and (step % cfg.every_k == 0 or step == cfg.steps):
            if cfg.sync:
                self.pub.flush()  # the baseline's update: the previous version committed first
            self._publish(step)
        groups = plan["groups"]
        rewards = [r for g in groups for r in g["rewards"]]
        stds = [float(torch.tensor(g["rewards"], dtype=torch.float64).std(unbiased=False)) for g in groups]
        tokens = sum(g["tokens"] for g in groups)
        now = time.time()
        made = self.workers.tokens if self.workers is not None else 0
        dt = now - self._last[0]
        line = {"step": step, "version": plan["version"], "reward_mean": sum(rewards) / len(rewards),
                "reward_std": sum(stds) / len(stds), "reward_min": min(rewards), "reward_max": max(rewards),
                "zero_std_groups": sum(s <= 1e-6 for s in stds), "loss": loss, "grad_norm": grad_norm,
                "tokens": tokens, "train_s": train_s, "trainer_tokens_per_s": tokens / train_s if train_s else None,
                "rollout_tokens_per_s": (made - self._last[1]) / dt if self.workers is not None and dt > 0 else None,
                "wait_s": plan.get("wait_s"), "groups": [g["gid"] for g in groups],
                "buffer": len(self.buffer) if self.buffer is not None else 0,
                "dropped_stale": self.buffer.dropped_stale if self.buffer is not None else 0,
                "rollout_failures": self.workers.failures.totals if self.workers is not None else {},
                "published_version": self.version,
                "curation": self.curated.stats() if self.curated is not None else None}
        self._last = (now, made)
        if recs:
            line.update(step_diagnostics(TokenRecord.cat(recs), plan["version"], loss_cfg))
        self.metrics.write("step", **line)
        log.info("step %d: reward %.3f, staleness %.2f, IS mean %.4f", step, line["reward_mean"],
                 line.get("staleness_mean") or 0.0, line.get("is_mean") or float("nan"))

    def close(self, summary: dict) -> dict:
        if self.pub is not None:
            self.pub.close()
        if self.workers is not None:
            self.workers.stop()
            summary["rollouts"] = self.workers.stats()
        if self.watcher is not None:
            if self.pub is not None:
                self._wait_engines_quietly()  # the engines' last versions belong in the metrics and the plot
            self.watcher.stop()
        lines = read_metrics(self.metrics.path)
        summary = {**summarize(lines), **summary, "final_version": self.version if self.pub else None}
        self.metrics.write("end", **summary)
        out = Path(self.cfg.out)
        (out / "summary.json").write_text(json.dumps(read_metrics(self.metrics.path)[-1], indent=1))
        if self.cfg.plot:
            try:
                from trainer.plots import plot_run

                plot_run(read_metrics(self.metrics.path), out / "run.png")
            except ImportError as exc:
                log.warning("no plot: %s", exc)
        self.abort()
        return summary

    def _wait_engines_quietly(self) -> None:
        try:
            self._wait_engines(self.version)
        except RuntimeError as exc:
            log.warning("%s", exc)

    def abort(self) -> None:
        if self.workers is not None:
            self.workers.stop(5)
        if self.buffer is not None:
            self.buffer.close()
        if self.watcher is not None:
            self.watcher._stop.set()
        if self._recorded is not None and not self._recorded.closed:
            self._recorded.close()
        self.metrics.close()
