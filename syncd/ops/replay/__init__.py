"""Replay ops: what the trainer needs to compute the distribution an engine sampled from
(``docs/trainer-replay.md``). Every op takes ``backend="auto"|"cpu"|"cuda"|"triton"|"reference"``; the plain-PyTorch
reference (``syncd/ops/reference/replay.py``) is the specification.

- :func:`kept_rows`: the row of every entry of a CSR list of kept sets (``ids``/``offsets``)
- :func:`kept_logprobs`: log-probabilities renormalised over each row's kept set (CSR ``ids``/``offsets``),
  differentiable, gathering only the kept entries (backends ``reference``, ``cpu`` native, ``triton``);
  :func:`kept_logprobs_vocab_parallel` for logits sharded over tensor-parallel ranks
- :func:`kept_sets`: the kept sets of top-k/top-p sampling (the engine's sampler and the trainer share it);
  :func:`kept_fingerprint` (32 bits per set) and :func:`rebuild_kept` (a recorded set from the trainer's logits,
  verified)
- :func:`pack_routes` / :func:`unpack_routes`: MoE expert ids at ``ceil(log2 E)`` bits each
- :func:`gather_routed`: combine weights of recorded experts (``NO_ROUTE`` gives 0), differentiable;
  :func:`route_dtype`: the compact dtype routes are held in
"""

from syncd.ops._replay_layout import bits_per_id, kept_rows
from syncd.ops.replay._kept import kept_logprobs
from syncd.ops.replay._parallel import kept_logprobs_vocab_parallel
from syncd.ops.replay._routes import NO_ROUTE, gather_routed, pack_routes, route_dtype, unpack_routes
from syncd.ops.replay._sets import (REBUILD_FINGERPRINT, REBUILD_OK, REBUILD_OVERLAP, KeptSets, RebuiltKept,
                                    kept_fingerprint, kept_sets, rebuild_kept)

__all__ = ["NO_ROUTE", "REBUILD_FINGERPRINT", "REBUILD_OK", "REBUILD_OVERLAP", "KeptSets", "RebuiltKept",
           "bits_per_id", "gather_routed", "kept_fingerprint", "kept_logprobs", "kept_logprobs_vocab_parallel",
           "kept_rows", "kept_sets", "pack_routes", "rebuild_kept", "route_dtype", "unpack_routes"]
