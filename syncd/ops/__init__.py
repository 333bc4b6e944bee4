"""The op surface of syncd. Every op takes ``backend="auto"|"cpu"|"cuda"|"triton"|"reference"``.

- :mod:`syncd.ops.delta`: ``encode``, ``decode``, ``apply_``, ``inspect`` (lossless weight deltas)
- :func:`checksum`: 64-bit content checksum of a tensor, identical on every backend and device
  (``checksum_many`` for a whole state dict on every core)
- :mod:`syncd.ops.nvfp4`: ``quantize``, ``dequantize`` and NVFP4 state dicts (``docs/nvfp4.md``)
- :mod:`syncd.ops.replay`: ``kept_logprobs`` (kept-set log-probabilities), MoE route packing and the routed
  gather (``docs/trainer-replay.md``)
"""

from syncd.ops import delta, nvfp4, replay
from syncd.ops._backend import BACKENDS
from syncd.ops._checksum import checksum, checksum_bytes, checksum_many

__all__ = ["BACKENDS", "checksum", "checksum_bytes", "checksum_many", "delta", "nvfp4", "replay"]
