"""The engine contract, owned by the daemon that drives it (``docs/architecture.md``), and the engine-side half of
it that every engine shares: engines in ``engine/`` (``syncd.engine``) implement and use it; nothing here imports
them.

Modules, one concept each: ``protocol`` (the :class:`Adapter` and :class:`Generator` protocols, the serving
types), ``update`` (:class:`Update`, one version to stage or load), ``params`` (:class:`ParamSpec` /
:class:`ParamPiece` and the layout helpers: spec checks, positions, expected checksums, word views), ``staging``
(what a staged update is and how it is written), ``updater`` (:class:`WeightUpdater`, the update machinery over an
engine's live tensors), ``in_place`` (:class:`InPlaceAdapter`, the whole Adapter of an engine that supplies only
its tensors, pause/resume and a hook for written parameters), ``wire`` (the control routes and their wire format,
in one table), ``errors`` (the boundary's error types), ``control`` (:class:`EngineControl`, the engine-side half
of the control routes), ``client`` (:class:`RemoteAdapter`, the daemon's client of an engine process) and
``local`` (:class:`InProcessLink`, an engine in the daemon's process with the same control state): both are an
:class:`EngineLink`, the one kind of engine the daemon drives.

The names below are imported on first use (``params``, ``wire`` and the update machinery load torch).
"""

from __future__ import annotations

from syncd.lazy import lazy_names

_LAZY = {
    "Adapter": "syncd.engines.protocol", "Generator": "syncd.engines.protocol",
    "SamplingParams": "syncd.engines.protocol", "GenerationRequest": "syncd.engines.protocol",
    "TokenEvent": "syncd.engines.protocol",
    "Update": "syncd.engines.update",
    "ParamSpec": "syncd.engines.params", "ParamPiece": "syncd.engines.params",
    "expected_checksums": "syncd.engines.params", "identity_specs": "syncd.engines.params",
    "build_local": "syncd.engines.params", "bf16_view_of_fp32": "syncd.engines.params",
    "StagedUpdate": "syncd.engines.staging",
    "WeightUpdater": "syncd.engines.updater", "InPlaceAdapter": "syncd.engines.in_place",
    "EngineControl": "syncd.engines.control",
    "OPS": "syncd.engines.wire", "WEIGHT_OPS": "syncd.engines.wire",
    "BadRequest": "syncd.engines.errors", "RemoteEngineError": "syncd.engines.errors",
    "EngineUnreachable": "syncd.engines.errors",
    "RemoteAdapter": "syncd.engines.client", "InProcessLink": "syncd.engines.local",
    "EngineLink": "syncd.engines.protocol", "CachedVersion": "syncd.engines.update",
    "ROUTES": "syncd.engines.wire",
}

__all__ = sorted(_LAZY)


__getattr__ = lazy_names("syncd.engines", _LAZY)
