"""Engines and their servers: the protocol an inference engine implements to take weight updates
(``engine.Adapter``) and to serve (``engine.Generator``) -- defined in :mod:`syncd.engines`, re-exported here --,
the reusable update machinery (``engine.WeightUpdater``), a headless
engine over plain tensors (``engine.StateDictEngine``), the replay recorder (``engine.ReplayRecorder``) and
the reference engine (``engine.reference.ReferenceEngine``). Names are imported lazily."""

from __future__ import annotations

from syncd.lazy import lazy_names

_LAZY = {
    # the engine contract lives in syncd.engines; re-exported here
    "Adapter": "syncd.engines.protocol", "Generator": "syncd.engines.protocol",
    "ParamSpec": "syncd.engines.params", "ParamPiece": "syncd.engines.params", "Update": "syncd.engines.update",
    "SamplingParams": "syncd.engines.protocol", "GenerationRequest": "syncd.engines.protocol",
    "TokenEvent": "syncd.engines.protocol",
    "WeightUpdater": "engine.updater", "StagedUpdate": "engine.staging", "expected_checksums": "engine.updater",
    "build_local": "engine.updater", "identity_specs": "engine.updater",
    "StateDictEngine": "engine.state_dict",
    "ReplayRecorder": "engine.replay", "TokenRecord": "engine.replay",
}

__all__ = sorted(_LAZY)


__getattr__ = lazy_names("engine", _LAZY)
