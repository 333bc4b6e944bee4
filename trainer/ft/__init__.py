"""The trainer's fault tolerance: per-step checkpoints, peer replicas, restore, live healing and elastic data
parallelism (``docs/trainer.md``, "Fault tolerance").

Modules, one concept each: ``checkpoint`` (:class:`Checkpointer`, asynchronous per-step checkpoints; the ranks'
agreement on a step they all hold), ``ckpt_dir`` (a checkpoint folder: layout, atomic write, verified read),
``ckpt_format`` (the one bundle format of checkpoints, replicas and live state), ``state_tree`` (the state's
nesting as tensors and a JSON skeleton), ``safetensors_view`` (tensors over verified safetensors bytes),
``replicas`` (placement and the clients of the replicas a peer holds), ``replica_server`` (:class:`ReplicaServer`),
``replica_wire`` (the job token and per-connection deadlines of every transfer), ``replica_secret`` (where the
job's replica secret is), ``peers`` (the peer directory, the owners' records, the replicator, the rebuild from
peers), ``fault_tolerance`` (:class:`FaultTolerance`: all of it for one owner, a rank or a replica group),
``step_checkpoints`` (:class:`StepCheckpoints`, what the step loop calls around each step), ``elastic``
(:class:`ElasticDP`, the torchft data-parallel object of the elastic job), ``heal`` (:class:`VerifiedTransport`,
torchft's live-state transport carrying only verified bytes) and ``plan_log`` (the elastic job's plan log in the
store).

Nothing here knows the RL loop: the state it checkpoints is the caller's. The names below are imported on first
use (``heal`` needs torchft, most others torch).
"""

from __future__ import annotations

from syncd.lazy import lazy_names

#: module -> its public names
_MODULES = {
    "checkpoint": ("CheckpointStats", "Checkpointer", "agreed_step", "agreement"),
    "ckpt_dir": ("Checkpoint", "capture_rng", "land_frame", "list_steps", "model_tensors", "newest_checkpoint",
                 "parse_checkpoint", "restore_rng", "runs_in", "step_dir", "write_bundle", "write_bundle_dir"),
    "ckpt_format": ("Bundle", "FORMAT", "MANIFEST", "MAX_MANIFEST_BYTES", "RunMismatch", "StateError",
                    "check_owner", "encode_manifest", "frame_prefix", "load_bundle", "manifest_digest",
                    "parse_manifest", "read_dir", "read_frame", "safetensors_header", "write_safetensors"),
    "elastic": ("ElasticDP", "start_lighthouse"),
    "fault_tolerance": ("FTConfig", "FaultTolerance", "agree_step", "default_node"),
    "heal": ("VerifiedTransport", "decode_state", "encode_state"),
    "peers": ("PeerDirectory", "Replicator", "rebuild_from_peers"),
    "plan_log": ("PlanLog", "PlanLogError"),
    "replica_secret": ("ENV_SECRET_FILE", "job_secret", "secret_path"),
    "replica_server": ("ReplicaServer",),
    "replica_wire": ("Deadline", "MIN_RATE", "ReplicaError", "replica_token", "transfer_deadline"),
    "replicas": ("fetch_checkpoint", "fetch_replica", "list_replicas", "place_replicas", "push_replica"),
    "safetensors_view": ("SAFETENSORS_DTYPES", "view_safetensors"),
    "state_tree": ("flatten", "unflatten"),
    "step_checkpoints": ("StepCheckpoints",),
}

_LAZY = {name: f"syncd.trainer.ft.{module}" for module, names in _MODULES.items() for name in names}

__all__ = sorted(_LAZY)

__getattr__ = lazy_names("syncd.trainer.ft", _LAZY)
