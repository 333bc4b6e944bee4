"""The concrete engines and their servers (``docs/engine.md``): a headless engine over plain tensors
(``syncd.engine.StateDictEngine``), the reference engine (``syncd.engine.reference.ReferenceEngine``), vLLM's
(``syncd.engine.vllm``), the HTTP server of a standalone engine process (``syncd.engine.control_server``), the
Dynamo worker (``syncd.engine.dynamo``), the proxy (``syncd.engine.proxy``) and the replay recorder
(``syncd.engine.ReplayRecorder``). The engine contract they implement and the update machinery they share
(``Adapter``, ``ParamSpec``, ``Update``, ``WeightUpdater``, ``InPlaceAdapter``, ``EngineControl``) are
:mod:`syncd.engines`'. Names are imported lazily."""

from __future__ import annotations

from syncd.lazy import lazy_names

_LAZY = {
    "StateDictEngine": "syncd.engine.state_dict",
    "ReplayRecorder": "syncd.engine.replay", "TokenRecord": "syncd.engine.replay",
}

__all__ = sorted(_LAZY)


__getattr__ = lazy_names("syncd.engine", _LAZY)
