"""The thin trainer's asynchronous RL side: rollouts in, a policy-gradient step out (``docs/trainer.md``,
``docs/trainer-replay.md``).

Modules, one concept each. ``config`` (:class:`LoopConfig`, a run's settings, and :class:`ConfigError`). The
step: ``loop`` (:func:`train`, the step loop written once over a data-parallel
object), ``plans`` (where a step's plan comes from), ``leadership`` (which replica group of an elastic job runs the
live side), ``objective`` (the loss), ``correction`` (importance
correction), ``logprobs`` (the trainer's log-probabilities, with kept-set and routing replay: ``kept``, ``replay``),
``batch`` (collation). The live side: ``live`` (:class:`LiveSide`: publishing, the rollout queue's feed, buffer,
plans, metrics), ``tasks`` (prompts and rewards), ``curation`` (the difficulty filter). Rollouts:
``rollout_service`` (``syncd rollouts``: prompt dispatch into the run's queue), ``group_queue`` (the queue in the
store), ``queue_ledger`` (the service's prompt ledger in it), ``queue_feed`` (the trainer's side: groups into the
buffer, returns to the service), ``rollout_workers`` (generation through the sandbox proxies), ``group_reader``
(a group read back from its records), ``rollouts`` (reading rollouts back from the store), ``compaction`` (training samples
of self-compacted trajectories), ``buffer`` (the rollout buffer, staleness bound), ``rl_state`` (the RL state a
restart restores), ``metrics`` and ``plots`` (the run's metrics lines and picture).

The names below are imported on first use (most modules load torch).
"""

from __future__ import annotations

from syncd.lazy import lazy_names

#: module -> its public names
_MODULES = {
    "batch": ("RolloutBatch", "collate"),
    "buffer": ("BufferClosed", "Group", "RolloutBuffer", "group_advantages"),
    "compaction": ("TrainingSample", "prefix_consistent", "sequence_rewards", "training_samples"),
    "config": ("ConfigError", "LoopConfig"),
    "correction": ("Correction", "RatioStats", "SourceSplit", "band_mask", "correct", "effective_sample_size",
                   "mismatch_by_source", "ratio_stats", "select_by_version", "sequence_rejection", "staleness",
                   "truncated_is"),
    "curation": ("CuratedTask", "CurationConfig", "CurationExhausted", "Curator", "Estimate", "KEPT", "TOO_EASY",
                 "TOO_HARD", "beta_tail"),
    "kept": ("FilledKept", "KeptRebuildError", "fill_kept"),
    "leadership": ("Deposed", "Leadership"),
    "live": ("LiveSide",),
    "logprobs": ("ReplayedLogprobs", "resolve_kept", "sampler_logprobs", "trainer_logprobs"),
    "loop": ("Job", "train"),
    "metrics": ("EngineWatcher", "MetricsLog", "publish_to_serving", "read_metrics", "summarize"),
    "objective": ("LossConfig", "TokenRecord", "policy_gradient_loss", "step_diagnostics"),
    "plans": ("BroadcastPlans", "LoggedPlans"),
    "plots": ("plot_run",),
    "replay": ("RoutingReplay", "RoutingReplayError", "SUPPORTED_ROUTERS", "moe_routers", "observe_routing",
               "routing_replay"),
    "group_queue": ("GroupQueue", "QueueError", "QueueState"),
    "group_reader": ("GroupReader",),
    "queue_feed": ("QueueFeed",),
    "queue_ledger": ("QueueSink",),
    "rl_state": ("LedgerError", "PromptLedger", "RestoreReport", "restore_groups"),
    "rollout_service": ("RolloutService", "ServiceConfig"),
    "rollout_workers": ("FAILURE_KINDS", "ProxyError", "RolloutWorkers", "Sampling", "complete", "proxy_models"),
    "rollouts": ("KeptSetError", "MissingReplayError", "NO_VERSION", "NonFiniteError", "PendingKept",
                 "RecordMismatchError", "Rollout", "RolloutError", "RolloutSequence", "RolloutSet", "RouteError",
                 "SegmentGapError", "UnpublishedVersionError", "read_rollouts"),
    "tasks": ("DEFAULT_TASK", "RewardFn", "Sample", "TASKS", "Task", "TaskItem", "get_task", "load_reward"),
}

_LAZY = {name: f"syncd.trainer.rl.{module}" for module, names in _MODULES.items() for name in names}

__all__ = sorted(_LAZY)

__getattr__ = lazy_names("syncd.trainer.rl", _LAZY)
