"""Moved to :mod:`syncd.engines` (the daemon owns the engine contract it drives; engines implement it): the
protocols in :mod:`syncd.engines.protocol`, ``Update`` in :mod:`syncd.engines.update`, the parameter specs in
:mod:`syncd.engines.params`. Kept until 0.3: each name imported from here warns (DeprecationWarning) with its new
path (``engine.Adapter`` and the other names of the ``engine`` package stay)."""

from syncd.lazy import lazy_names

_MOVED = {"ParamPiece": "syncd.engines.params", "ParamSpec": "syncd.engines.params", "Update": "syncd.engines.update",
          **{n: "syncd.engines.protocol" for n in ("Adapter", "SamplingParams", "GenerationRequest", "TokenEvent",
                                                   "Generator")}}

__all__ = list(_MOVED)

__getattr__ = lazy_names(__name__, _MOVED, deprecated=True)
