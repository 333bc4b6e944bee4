"""The front end's side of replay records on vLLM (:mod:`syncd.engine.vllm.engine`): :class:`ReplayConfig` (where the
worker records), :func:`check_request` (which requests are recorded, and refusing those that cannot be), the model
facts the checks need (:func:`model_facts`, :func:`moe_shape`) and :class:`WorkerRecorders`. Pure functions but
for the configuration file read; thread-safe."""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["ReplayConfig", "WorkerRecorders", "check_request", "model_facts", "moe_shape"]


@dataclass(frozen=True)
class ReplayConfig:
    """Where and how the worker records replay records (:class:`syncd.engine.replay.ReplayRecorder`'s arguments):
    ``store`` (a URL or path the worker process opens), ``run_id``, ``kept_tolerance`` (None: every kept set
    listed), ``chunk_tokens``, ``spill_dir`` (refused chunks are kept there until the store takes them) and
    ``retry_s``."""

    store: str
    run_id: str
    kept_tolerance: float | None = None
    chunk_tokens: int = 1024
    spill_dir: str | None = None
    retry_s: float = 5.0


def check_request(request, replay: bool | None, *, has_store: bool, vocab_size: int | None) -> bool:
    """Whether ``request`` (a :class:`syncd.engines.GenerationRequest`) is recorded: ``replay`` True/False, or None
    for the engine's default (recorded when it has a replay store). Raises ValueError naming the field for a
    request that cannot be: replay asked of an engine without a replay store, ``temperature``, ``top_k`` (beyond
    the vocabulary), ``top_p`` (outside (0, 1])."""
    record = has_store if replay is None else bool(replay)
    if record and not has_store:
        raise ValueError(f"request {request.request_id!r}: replay asked of an engine started without a replay store")
    if record:
        from syncd.engine.vllm.kept import check_sampling

        sp = request.sampling
        try:
            check_sampling(sp.temperature, sp.top_k, sp.top_p, vocab_size)
        except ValueError as exc:
            raise ValueError(f"request {request.request_id!r}: {exc}") from None
    return record


def moe_shape(hf_config) -> tuple[int, int]:
    """``(num_experts, top_k)`` of a transformers config (or an object with its attributes); ``(0, 0)`` for a
    dense model."""
    experts = int(getattr(hf_config, "num_experts", 0) or getattr(hf_config, "num_local_experts", 0) or 0)
    return (experts, int(getattr(hf_config, "num_experts_per_tok", 0) or 0)) if experts else (0, 0)


class WorkerRecorders:
    """The ``flush`` of the recorders in a :class:`VLLMEngine`'s workers (what the Dynamo worker calls on a
    recorder before it exits)."""

    def __init__(self, engine):
        self.engine = engine

    def flush(self, timeout: float | None = 60.0) -> None:
        self.engine.flush_replay(60.0 if timeout is None else timeout)


def model_facts(model_dir: str) -> tuple[int | None, int]:
    """``(vocab_size, num_experts)`` of the folder's ``config.json`` (None, 0 where it does not say)."""
    import json
    from types import SimpleNamespace

    try:
        cfg = json.loads(open(os.path.join(model_dir, "config.json")).read())
    except (OSError, ValueError):
        return None, 0
    cfg = cfg.get("text_config", cfg) if isinstance(cfg, dict) else {}
    return cfg.get("vocab_size"), moe_shape(SimpleNamespace(**cfg))[0]
