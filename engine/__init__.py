"""Engines and their servers: the protocol an inference engine implements to take weight updates
(``syncd.engines.Adapter``) and to serve (``syncd.engines.Generator``) -- defined in :mod:`syncd.engines`, re-exported here --,
the reusable update machinery (``syncd.engine.WeightUpdater``), a headless
engine over plain tensors (``syncd.engine.StateDictEngine``), the replay recorder (``syncd.engine.ReplayRecorder``) and
the reference engine (``syncd.engine.reference.ReferenceEngine``). Names are imported lazily."""

from __future__ import annotations

from syncd.lazy import lazy_names

_LAZY = {
    # the engine contract lives in syncd.engines; re-exported here
    "Adapter": "syncd.engines.protocol", "Generator": "syncd.engines.protocol",
    "ParamSpec": "syncd.engines.params", "ParamPiece": "syncd.engines.params", "Update": "syncd.engines.update",
    "SamplingParams": "syncd.engines.protocol", "GenerationRequest": "syncd.engines.protocol",
    "TokenEvent": "syncd.engines.protocol",
    "WeightUpdater": "syncd.engine.updater", "StagedUpdate": "syncd.engine.staging", "expected_checksums": "syncd.engine.updater",
    "build_local": "syncd.engine.updater", "identity_specs": "syncd.engine.updater",
    "StateDictEngine": "syncd.engine.state_dict",
    "ReplayRecorder": "syncd.engine.replay", "TokenRecord": "syncd.engine.replay",
}

__all__ = sorted(_LAZY)


__getattr__ = lazy_names("syncd.engine", _LAZY)
