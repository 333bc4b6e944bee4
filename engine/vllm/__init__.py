"""syncd's vLLM engine: :class:`~syncd.engine.vllm.engine.VLLMEngine` (``Adapter`` + ``Generator`` over vLLM's
``AsyncLLM``), the worker side inside vLLM (:mod:`syncd.engine.vllm.worker_ext`: the ``syncd`` weight-transfer backend
and worker extension), vLLM's parameter layout in the trainer's names (:mod:`syncd.engine.vllm.layout`) and replay
records: kept sets sampled by syncd's logits processor (:mod:`syncd.engine.vllm.kept`), recorded inside the worker
(:mod:`syncd.engine.vllm.recording`) where :class:`~syncd.engine.vllm.replay_config.ReplayConfig` says, and vLLM's own
Model Runner V2 fields mapped onto records (:mod:`syncd.engine.vllm.replay`). Needs the ``vllm`` extra; names are
imported lazily, so importing this package does not import vLLM."""

from __future__ import annotations

from syncd.lazy import lazy_names

_LAZY = {"VLLMEngine": "syncd.engine.vllm.engine", "ReplayConfig": "syncd.engine.vllm.replay_config",
         "vllm_specs": "syncd.engine.vllm.layout", "ModelShape": "syncd.engine.vllm.layout"}

__all__ = sorted(_LAZY)

__getattr__ = lazy_names("syncd.engine.vllm", _LAZY)
