"""Replay ops: what the trainer needs to compute the distribution an engine sampled from
(``docs/trainer-replay.md``). Every op takes ``backend="auto"|"cpu"|"cuda"|"triton"|"reference"``; the plain-PyTorch
reference (``syncd/ops/reference/replay.py``) is the specification.

- :func:`kept_logprobs`: log-probabilities renormalised over each row's kept set (CSR ``ids``/``offsets``),
  differentiable, gathering only the kept entries (backends ``reference``, ``cpu`` native, ``triton``);
  :func:`kept_logprobs_vocab_parallel` for logits sharded over tensor-parallel ranks
- :func:`pack_routes` / :func:`unpack_routes`: MoE expert ids at ``ceil(log2 E)`` bits each
- :func:`gather_routed`: combine weights of recorded experts (``NO_ROUTE`` gives 0), differentiable;
  :func:`route_dtype`: the compact dtype routes are held in
"""

from syncd.ops.replay._kept import kept_logprobs
from syncd.ops.replay._parallel import kept_logprobs_vocab_parallel
from syncd.ops.replay._routes import NO_ROUTE, bits_per_id, gather_routed, pack_routes, route_dtype, unpack_routes

__all__ = ["NO_ROUTE", "bits_per_id", "gather_routed", "kept_logprobs", "kept_logprobs_vocab_parallel",
           "pack_routes", "route_dtype", "unpack_routes"]
