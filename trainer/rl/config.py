"""The thin trainer's run configuration: :class:`LoopConfig`, every setting of a run, and :class:`ConfigError`,
the error a bad one raises (its message names the flag).

Light to import (no torch): :meth:`LoopConfig.check` imports what it checks against when called.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ConfigError", "LoopConfig"]


class ConfigError(ValueError):
    """A configuration the loop cannot run; the message names the flag."""


@dataclass(frozen=True)
class LoopConfig:
    """What a run runs (:func:`syncd.trainer.jobs.run_job`; ``python -m syncd.trainer.run --help`` describes each
    setting as its flag). Frozen: every rank and replica group holds the same one."""

    model: str
    store: str
    run_id: str
    out: str
    proxies: tuple[str, ...] = ()
    external_rollouts: bool = False
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
    standby: bool = False
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
    leader_timeout_s: float = 10.0
    curation: object | None = None  # a syncd.trainer.rl.curation.CurationConfig: the task sampler's difficulty filter

    def check(self) -> None:
        """Raise :class:`ConfigError` naming the flag of the first bad setting: a number out of range (NaN and
        +-inf are out of every range), a run id that is not one, a proxy that is not an ``http(s)://`` URL, a store
        URL that cannot be opened (:meth:`open_store`)."""
        from syncd.publish.shard_writer import delta_formats
        from syncd.trainer.rl.objective import LossConfig
        from syncd.trainer.optim import OPTIMIZERS
        from syncd.trainer.rl.tasks import get_task

        for flag, var, value in (("--store", "SYNCD_STORE", self.store), ("--run-id", "SYNCD_RUN_ID", self.run_id)):
            if not value:
                raise ConfigError(f"{flag} is required (or its variable, {var})")
        rules = [(self.every_k >= 1, "--every-k", f"K must be >= 1, got {self.every_k}"),
                 (self.full_every >= 1, "--full-every", f"must be >= 1 (1: every version full), got {self.full_every}"),
                 (_finite(self.temperature) and self.temperature > 0, "--temperature",
                  f"must be a finite number > 0, got {self.temperature}"),
                 (0 < self.top_p <= 1, "--top-p", f"must be in (0, 1], got {self.top_p}"),
                 (self.top_k >= 0, "--top-k", f"must be >= 0 (0: off), got {self.top_k}"),
                 (_finite(self.weight_decay) and self.weight_decay >= 0, "--weight-decay",
                  f"must be a finite number >= 0, got {self.weight_decay}"),
                 (_finite(self.grad_clip) and self.grad_clip >= 0, "--grad-clip",
                  f"must be a finite number >= 0 (0: off), got {self.grad_clip}"),
                 (_finite(self.rollout_timeout_s) and self.rollout_timeout_s > 0, "--rollout-timeout",
                  f"must be a finite number of seconds > 0, got {self.rollout_timeout_s}"),
                 (_finite(self.ft_timeout_s) and self.ft_timeout_s > 0, "--ft-timeout",
                  f"must be a finite number of seconds > 0, got {self.ft_timeout_s}"),
                 (self.max_lag >= 0, "--max-lag", f"the staleness bound eta must be >= 0, got {self.max_lag}"),
                 (self.steps >= 1, "--steps", f"must be >= 1, got {self.steps}"),
                 (self.group_size >= 2, "--group-size", f"a group needs >= 2 samples, got {self.group_size}"),
                 (self.groups_per_step >= 1, "--groups-per-step", f"must be >= 1, got {self.groups_per_step}"),
                 (self.lookahead is None or self.lookahead >= self.groups_per_step, "--lookahead",
                  f"must be >= --groups-per-step ({self.groups_per_step}), got {self.lookahead}"),
                 (_finite(self.lr) and self.lr > 0, "--lr", f"must be a finite number > 0, got {self.lr}"),
                 (self.threads >= 1, "--threads", f"must be >= 1, got {self.threads}"),
                 (self.optimizer in OPTIMIZERS, "--optimizer",
                  f"unknown optimizer {self.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}"),
                 (self.plans is not None or bool(self.proxies) or self.external_rollouts, "--proxy",
                  "at least one proxy URL is needed (or --external-rollouts, or --plans to train offline)"),
                 (not (self.external_rollouts and self.proxies), "--external-rollouts",
                  "the groups come from syncd rollouts processes: give them the --proxy URLs, not the trainer"),
                 (not self.sync or self.daemon_status is not None, "--daemon-status",
                  "the synchronous baseline (--sync) waits for the engines through the daemon's status file"),
                 (not (self.sync and self.plans), "--sync", "cannot be combined with --plans"),
                 (self.checkpoint_dir is not None or not self.resume, "--resume",
                  "needs --checkpoint-dir (where the run's checkpoints are)"),
                 (not self.standby or self.resume, "--standby",
                  "a standby takes a run over from its checkpoints: it needs --resume (and --checkpoint-dir)"),
                 (not (self.standby and self.lighthouse), "--standby",
                  "is for the plain job; an elastic job's restarted group joins the others as it is"),
                 (self.replicas >= 0, "--replicas", f"must be >= 0, got {self.replicas}"),
                 (self.keep_checkpoints >= 1, "--keep-checkpoints", f"must be >= 1, got {self.keep_checkpoints}"),
                 (self.checkpoint_busy in ("skip", "wait"), "--checkpoint-busy",
                  f"must be skip or wait, got {self.checkpoint_busy!r}"),
                 (self.replica_groups >= 1 and 0 <= self.replica_group < self.replica_groups, "--replica-group",
                  f"must be in [0, --replica-groups={self.replica_groups}), got {self.replica_group}"),
                 (1 <= self.min_replicas <= self.replica_groups, "--min-replicas",
                  f"must be in [1, --replica-groups={self.replica_groups}], got {self.min_replicas}"),
                 (_finite(self.leader_timeout_s) and self.leader_timeout_s > 1.0, "--leader-timeout",
                  f"must be a number of seconds above 1, got {self.leader_timeout_s}"),
                 (self.lighthouse is None or not self.sync, "--sync", "the elastic job (--lighthouse) runs async"),
                 (self.delta_format in (1, 2), "--delta-format", f"must be 1 or 2, got {self.delta_format!r}")]
        for ok, flag, msg in rules:
            if not ok:
                raise ConfigError(f"{flag}: {msg}")
        from syncd import manifest as mf
        from syncd.urls import check_http_url

        for flag, check in (("--run-id", lambda: mf.check_run_id(self.run_id)),
                            ("--proxy", lambda: [check_http_url(u, "--proxy") for u in self.proxies])):
            try:
                check()
            except ValueError as exc:
                raise ConfigError(str(exc) if str(exc).startswith(flag) else f"{flag}: {exc}") from None
        self.open_store()
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

    def open_store(self):
        """The run's :class:`~syncd.store.Store`, or :class:`ConfigError` naming ``--store``: a URL of an unknown
        scheme, a path that looks like a mistyped URL (``s3:/bucket``), a cloud URL its client refuses. A live run
        owns its store: a local folder not there yet is created (the publisher writes the run's first version);
        an offline run (``plans``) reads records that must already be there."""
        from syncd.store import Store

        flag = "--store (or SYNCD_STORE)"
        if "://" not in self.store and re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", self.store):
            raise ConfigError(f"{flag}: {self.store!r} looks like a URL missing the '//' after its scheme (use "
                              "file://, memory://, s3://, gs:// or az://, or a plain path)")
        try:
            return Store.open(self.store, create=self.plans is None)
        except (ValueError, OSError) as exc:
            raise ConfigError(f"{flag}: {exc}") from None


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)
