"""The op surface of syncd. Every op takes ``backend="auto"|"cpu"|"cuda"|"triton"|"reference"``.

- :mod:`syncd.ops.delta`: ``encode``, ``decode``, ``apply_``, ``inspect`` (lossless weight deltas)
- :func:`checksum`: 64-bit content checksum of a tensor, identical on every backend and device
  (``checksum_many`` for a whole state dict on every core)
- :mod:`syncd.ops.nvfp4`: ``quantize``, ``dequantize`` and NVFP4 state dicts (``docs/nvfp4.md``)
- :mod:`syncd.ops.replay`: ``kept_logprobs`` (kept-set log-probabilities), MoE route packing and the routed
  gather (``docs/trainer-replay.md``)
- :func:`scatter_words_`: staged words into many word arrays at once, all or nothing, compared as written
  (an engine's in-place apply and rollback)
- :func:`available` (whether a backend can run on a device, and why not), :func:`threads` (what the native
  CPU backend uses), :func:`native_features`

Each op registers its kernels once in one dispatch table (``syncd/ops/_dispatch.py``), next to its reference.
"""

from syncd.ops import delta, nvfp4, replay
from syncd.ops._backend import BACKENDS, available, threads
from syncd.ops._checksum import checksum, checksum_bytes, checksum_many
from syncd.ops.scatter import scatter_words_

__all__ = ["BACKENDS", "available", "checksum", "checksum_bytes", "checksum_many", "delta", "native_features",
           "nvfp4", "replay", "scatter_words_", "threads"]


def native_features() -> dict:
    """What the native CPU module was built with: ``{"available", "codec_simd", "nvfp4_simd", "kept_logprobs"}``
    (all False when it was not built; ``codec_simd``: the codec kernels' SIMD level, as the module names it)."""
    from syncd.errors import BackendUnavailable
    from syncd.ops._backend import native

    try:
        mod = native()
    except BackendUnavailable:
        return {"available": False, "codec_simd": False, "nvfp4_simd": False, "kept_logprobs": False}
    return {"available": True, "codec_simd": getattr(mod, "CODEC_SIMD", False),
            "nvfp4_simd": bool(getattr(mod, "NVFP4_SIMD", False)), "kept_logprobs": hasattr(mod, "kept_forward")}
