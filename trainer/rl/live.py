"""The live side of the thin trainer (rank 0, or the leading replica group): publishing, the rollout queue, the rollout
buffer, plans, metrics -- and the RL state that survives a restart.

The trainer never dispatches a prompt: the groups come from the rollout service through the run's queue in the store
(:mod:`syncd.trainer.rl.rollout_service`, :mod:`syncd.trainer.rl.queue_feed`). With ``--proxy`` the service runs in
this process (one machine: the same code as ``syncd rollouts``, on the trainer's task object and version); with
``--external-rollouts`` it runs as its own processes, which keep generating while the trainer is away. What the
buffer drops or refuses goes back to the service to be generated again; in the synchronous baseline the trainer's
position is written only once the engines serve its version, so each step's groups are generated on it.

:meth:`LiveSide.snapshot` is the RL-state part of a step's checkpoint, taken between two steps: the trainer
step, the trainer version, the difficulty filter's state (with curation), the rollout buffer's snapshot (the
prompt ledger's consumed bits, every buffered group with its per-token versions, the policy's state) and the
queue position (``queue``: where to read on). :meth:`LiveSide.start` with a restored snapshot applies the buffer
policy (:func:`syncd.trainer.rl.rl_state.restore_groups`), sends what it drops back to the service, reads the queue on
from the checkpointed position (skipping what is buffered, trained or was sent back), and keeps the versions
monotonic: the publisher numbers after the run's newest *valid* version, and when that is not the
version the restored step had published (it never committed, or -- with fewer durable replicas than asked -- a newer one
from a lost future exists), the restored weights are published at once as a full version, so the engines leave any
weights the restored trainer cannot continue from. With checkpoints on, a version becomes visible only once its step's
checkpoint is on disk and offered to every replica holder (the publisher's ``commit_gate``), so in the normal case the
restored step is never behind what the engines serve.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict
from pathlib import Path

import torch

from syncd.trainer.rl.buffer import BufferClosed, RolloutBuffer
from syncd.trainer.rl.config import ConfigError
from syncd.trainer.rl.metrics import EngineWatcher, MetricsLog, read_metrics, summarize
from syncd.trainer.rl.objective import LossConfig, TokenRecord, step_diagnostics

log = logging.getLogger(__name__)

__all__ = ["LiveSide"]


def _truncate_jsonl(path: Path, keep) -> None:
    """Rewrite a JSON-lines file atomically with only the lines ``keep(doc)`` accepts (unparsable ones dropped)."""
    if not path.exists():
        return
    lines = []
    for ln in path.read_text().splitlines():
        try:
            if keep(json.loads(ln)):
                lines.append(ln)
        except (ValueError, KeyError, TypeError):
            continue
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(ln + "\n" for ln in lines))
    os.replace(tmp, path)


class LiveSide:
    """See the module docstring. ``resume_step``: a restored run's step; ``metrics.jsonl`` and ``plans.jsonl``
    are kept up to it (the lines of steps after it, never committed, and a torn last line removed) instead of
    started afresh; ``commit_gate(step)``: the publisher's, see :class:`syncd.trainer.WeightPublisher`."""

    def __init__(self, cfg, model, *, resume_step: int | None = None, commit_gate=None):
        self.cfg, self.model, self.commit_gate = cfg, model, commit_gate
        out = Path(cfg.out)
        out.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            _truncate_jsonl(out / "metrics.jsonl", lambda d: d.get("kind") != "step" or d["step"] <= resume_step)
            if not cfg.plans:
                _truncate_jsonl(out / "plans.jsonl", lambda d: d["step"] <= resume_step)
        self.metrics = MetricsLog(out / "metrics.jsonl", truncate=resume_step is None)
        self.version, self.step, self.published_step = 0, 0, None
        self.pub = self.workers = self.watcher = self.buffer = self.resolver = self.feed = self.service = None
        self._recorded = None if cfg.plans else open(out / "plans.jsonl", "w" if resume_step is None else "a")
        self._plans = None
        self._live_groups: dict[int, list] = {}
        self._last = (time.time(), 0)
        self.restore_report: dict | None = None
        self.curated = None

    def start(self, restored: dict | None = None, settled=()) -> None:
        """Start publishing and generating; ``restored``: the RL state of a restored checkpoint (or of the live
        state another replica group logged); ``settled``: the plans trained after that state (their prompts
        consumed before the queue feed reads anything)."""
        cfg = self.cfg
        self.metrics.write("start", config={k: v for k, v in asdict(cfg).items()}, resumed=restored is not None)
        if cfg.daemon_status:
            self.watcher = EngineWatcher(cfg.daemon_status, self.metrics).start()
        if cfg.plans:
            self._plans = [json.loads(ln) for ln in Path(cfg.plans).read_text().splitlines() if ln.strip()]
            return
        from syncd.publish.publisher import WeightPublisher
        from syncd.versions import has_versions, latest_version
        from syncd.trainer.rl import episodes
        from syncd.trainer.rl.group_queue import GroupQueue
        from syncd.trainer.rl.group_reader import GroupReader
        from syncd.trainer.rl.kept_resolver import KeptResolver
        from syncd.trainer.rl.queue_feed import QueueFeed
        from syncd.trainer.rl.rollout_service import RolloutService, ServiceConfig
        from syncd.trainer.rl.rollout_workers import ProxyError, proxy_models
        from syncd.trainer.rl.tasks import get_task, load_reward

        try:
            for u in cfg.proxies:
                proxy_models(u)
        except ProxyError as exc:
            raise ConfigError(f"--proxy: no engines reachable: {exc}") from None
        if restored is None and has_versions(cfg.store, cfg.run_id):
            raise ConfigError(f"--run-id: run {cfg.run_id} already has versions in {cfg.store}; the engines start "
                              "from version 0: use a new run id (or --resume with its --checkpoint-dir)")
        newest = None if restored is None else latest_version(cfg.store, cfg.run_id)
        task = get_task(cfg.task, length=cfg.task_length)
        reward = load_reward(cfg.reward) if cfg.reward else task.reward
        if cfg.curation is not None:
            from syncd.trainer.rl.curation import CuratedTask

            task = self.curated = CuratedTask(task, cfg.curation)
        self.pub = WeightPublisher(cfg.store, cfg.run_id, every_k=1, full_every=cfg.full_every,
                                   commit_gate=self.commit_gate, delta_format=cfg.delta_format,
                                   sliced_tensors=cfg.sliced_tensors)
        reader = GroupReader(cfg.store, cfg.run_id, vocab_size=self.model.config.vocab_size,
                             record_timeout_s=cfg.record_timeout_s, multi_turn=episodes.episodic(task) is not None)
        self.buffer = RolloutBuffer(0 if cfg.sync else cfg.max_lag, on_drop=lambda gs: self.feed.send_back_groups(gs),
                                    vet=self._vet, frontier=lambda: self.feed.frontier())
        self.resolver = KeptResolver(self.model, cfg.store, cfg.run_id)  # kept sets to rebuild, as groups land
        self.feed = QueueFeed(GroupQueue(cfg.store, cfg.run_id), self.buffer,
                              lambda doc: self._resolved(reader.reread(doc)),
                              positions=(restored or {}).get("queue"), step=lambda: self.step,
                              version=lambda: self.version, auto_publish=not cfg.sync,
                              lookahead=cfg.groups_per_step if cfg.sync else
                              cfg.lookahead or cfg.groups_per_step * (1 + min(cfg.max_lag, 1)))
        if restored is None:
            self.pub.publish_model_files(cfg.model)  # config + tokenizer: `syncd materialize` needs no --config-from
            self._publish(0)
        else:
            self._restore(restored, newest, reader)
        for plan in settled:
            self.adopt(plan, consumed=True)
        if cfg.proxies:  # one machine: the rollout service runs in this process, on the trainer's task object
            self.service = RolloutService(ServiceConfig(
                store=cfg.store, run_id=cfg.run_id, proxies=list(cfg.proxies), task=cfg.task,
                task_length=cfg.task_length, reward=cfg.reward, group_size=cfg.group_size,
                workers=cfg.workers or cfg.groups_per_step, temperature=cfg.temperature, top_p=cfg.top_p,
                top_k=cfg.top_k, seed=cfg.seed, max_backlog=self.feed.lookahead, poll_interval_s=0.05,
                vocab_size=self.model.config.vocab_size, request_timeout_s=cfg.request_timeout_s,
                record_timeout_s=cfg.record_timeout_s), task=task, reward=reward, version=lambda: self.version,
                step=lambda: self.step).start()
            self.workers = self.service.workers
        self.feed.start()

    def _restore(self, rl: dict, newest: int | None, reader) -> None:
        """Apply the buffer policy to the restored RL state; what it drops goes back to the rollout service."""
        from syncd.trainer.rl.rl_state import restore_groups

        self.step, self.version = int(rl["step"]), int(rl["version"])
        lineage = self.version if newest is None else min(newest, self.version)
        if newest != self.version:
            log.warning("restore: the run's newest valid version is %s, the restored step %d had published %d; "
                        "publishing the restored weights as a full version first", newest, self.step, self.version)
            self.version = -1 if newest is None else newest
            self._publish(self.step)
        ledger, groups, report = restore_groups(
            rl["buffer"], version=self.version, max_lag=self.buffer.max_lag, newest_published=lineage,
            policy=self.buffer.policy, reread=lambda doc: self._resolved(reader.reread(doc)),
            recover=lambda index, entry: None)  # nothing is in flight in the trainer: the service owns dispatch
        attempts = {int(d["item"]["index"]): int(d.get("attempt") or 0) for d in rl["buffer"].get("groups", [])}
        for reason in ("dropped_stale", "dropped_mismatch", "dropped_foreign", "dropped_cap"):
            for index in getattr(report, reason):
                if index in attempts:
                    self.feed.send_back(index, attempts[index], f"{reason} when the trainer restored step {self.step}")
        self.buffer.restore(ledger, groups, int(rl["buffer"].get("dropped_stale", 0)) + len(report.dropped_stale))
        if self.curated is not None and rl.get("curation") is not None:
            self.curated.load_state_dict(rl["curation"])  # the difficulty filter's estimates survive the restart
        self.restore_report = report.counts()
        self.metrics.write("restore", step=self.step, version=self.version, newest_valid=newest, **report.counts())
        log.warning("restore: step %d, version %d, buffer: %s", self.step, self.version, report.counts())

    def _vet(self, group):
        """A finished group, checked before the buffer takes it (``RolloutBuffer(vet=)``; raising refuses it, its
        prompt is regenerated): every token of a published version -- none newer than the trainer's version, which
        moves before a version can be visible, none of no version --, then its kept sets to rebuild rebuilt from the
        versions that sampled them (:mod:`syncd.trainer.rl.kept_resolver`; a set that does not verify refuses it)."""
        from syncd.trainer.rl.rollouts import NO_VERSION, UnpublishedVersionError

        newest = self.version
        bad = sorted(v for v in group.versions if v == NO_VERSION or v > newest)
        if bad:
            raise UnpublishedVersionError(
                f"group of prompt {group.item.index}: {sum(group.versions[v] for v in bad)} token(s) claim version "
                f"{bad[-1] if bad[-1] != NO_VERSION else 'none'}, which the trainer never published (its newest is "
                f"{newest})")
        return self._resolved(group)

    def _resolved(self, group):
        if group is not None and group.rollouts is not None:
            group.rollouts = self.resolver.rollouts(group.rollouts)
        return group

    def snapshot(self) -> dict:
        """The RL state of this step boundary (JSON-able; module docstring)."""
        curation = self.curated.state_dict() if self.curated is not None else None
        if self.buffer is None:
            return {"step": self.step, "version": self.version, "buffer": None, "curation": curation}
        return {"step": self.step, "version": self.version, "buffer": self.buffer.snapshot(), "curation": curation,
                "queue": self.feed.positions()}

    def _publish(self, step: int) -> None:
        t = time.time()
        stall = time.perf_counter()
        # the trainer's version moves before the new one can be visible: a record of a version above it was never
        # published (the rollout workers refuse it)
        self.version = 0 if step == 0 else self.version + 1
        self.pub.publish(self.model, step)
        self.published_step = step
        self.metrics.write("publish", version=self.version, step=step, stall_s=time.perf_counter() - stall, t=t)

    def plan(self, step: int) -> dict:
        self.step = step
        if self._plans is not None:
            return self._plans[step - 1]
        cfg, t0 = self.cfg, time.perf_counter()
        if cfg.sync:
            self._wait_engines(self.version)
            self._let_generate()
        try:
            groups = self.buffer.take(cfg.groups_per_step, self.version, timeout_s=cfg.rollout_timeout_s)
        except (TimeoutError, BufferClosed) as exc:
            raise RuntimeError(f"no rollouts: {exc}; {self.rollout_stats()}") from None
        for g in groups:
            self._live_groups[g.gid] = g.rollouts
        plan = {"kind": "plan", "step": step, "version": self.version, "wait_s": time.perf_counter() - t0,
                "groups": [g.plan() for g in groups]}
        self.record(plan)
        return plan

    def adopt(self, plan: dict, *, consumed: bool) -> None:
        """A plan this live side did not make (logged by an earlier leader, :mod:`syncd.trainer.rl.plans`): its
        prompts leave the buffer (``consumed``: trained already); one still to train is recorded as its own are."""
        indices = [g["item"]["index"] for g in plan["groups"]]
        if self.buffer is not None:
            self.buffer.remove(indices)
            if consumed:
                self.buffer.consume(indices)
        if not consumed:
            self.record(plan)

    def _let_generate(self) -> None:
        """Synchronous baseline: the engines serve the trainer's version; the services may generate a step."""
        from syncd.errors import StoreError

        deadline = time.monotonic() + self.cfg.engine_timeout_s
        while True:
            try:
                return self.feed.publish_position()
            except StoreError as exc:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"cannot write the trainer's position to the rollout queue: {exc}") from None
                time.sleep(0.5)

    def rollout_stats(self) -> dict:
        """The rollout queue feed's counts and, with the service in this process, its own."""
        return {"feed": self.feed.stats() if self.feed is not None else None,
                "service": self.service.stats() if self.service is not None else None}

    def record(self, plan: dict) -> None:
        """Append ``plan`` to ``plans.jsonl`` (nothing when training offline on recorded plans)."""
        if self._recorded is None:
            return
        self._recorded.write(json.dumps(plan) + "\n")
        self._recorded.flush()

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
                    loss_cfg: LossConfig, **extra) -> None:
        """The step committed: its prompts are consumed, a version published when due, the step's metrics line."""
        cfg = self.cfg
        if self.buffer is not None:
            self.buffer.consume(g["item"]["index"] for g in plan["groups"])
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
                "refused_groups": dict(self.buffer.refused) if self.buffer is not None else {},
                "published_version": self.version,
                "curation": self.curated.stats() if self.curated is not None else None, **extra}
        self._last = (now, made)
        if recs:
            line.update(step_diagnostics(TokenRecord.cat(recs), plan["version"], loss_cfg))
        self.metrics.write("step", **line)
        log.info("step %d: reward %.3f, staleness %.2f, IS mean %.4f", step, line["reward_mean"],
                 line.get("staleness_mean") or 0.0, line.get("is_mean") or float("nan"))

    def close(self, summary: dict) -> dict:
        if self.pub is not None:
            self.pub.close()
        if self.feed is not None:
            self._stop_rollouts()
            summary["rollouts"] = {**(self.workers.stats() if self.workers is not None else {}),
                                   "queue": self.feed.stats(), "kept_resolved": self.resolver.stats(),
                                   "service": self.service.stats()["queue"] if self.service is not None else None}
        if self.watcher is not None:
            if self.pub is not None:
                self._wait_engines_quietly()  # the engines' last versions belong in the metrics and the plot
            self.watcher.stop()
        lines = read_metrics(self.metrics.path)
        summary = {**summarize(lines), **summary, "final_version": self.version if self.pub else None}
        if self.restore_report is not None:
            summary["restored"] = self.restore_report
        self.metrics.write("end", **summary)
        out = Path(self.cfg.out)
        (out / "summary.json").write_text(json.dumps(read_metrics(self.metrics.path)[-1], indent=1))
        if self.cfg.plot:
            try:
                from syncd.trainer.rl.plots import plot_run

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

    def _stop_rollouts(self, timeout_s: float = 30.0) -> None:
        if self.service is not None:
            self.service.stop(timeout_s)
        if self.feed is not None:
            self.feed.stop(timeout_s)

    def abort(self) -> None:
        self._stop_rollouts(5)
        if self.buffer is not None:
            self.buffer.close()
        if self.watcher is not None:
            self.watcher._stop.set()
        if self._recorded is not None and not self._recorded.closed:
            self._recorded.close()
        self.metrics.close()
