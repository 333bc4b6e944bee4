"""Moved to :mod:`syncd.engines` (the daemon owns the engine contract it drives; engines implement it): the
protocols in :mod:`syncd.engines.protocol`, ``Update`` in :mod:`syncd.engines.update`, the parameter specs in
:mod:`syncd.engines.params`. These names are re-exported here, kept for one release."""

from syncd.engines.params import ParamPiece, ParamSpec  # noqa: F401
from syncd.engines.protocol import Adapter, GenerationRequest, Generator, SamplingParams, TokenEvent  # noqa: F401
from syncd.engines.update import Update  # noqa: F401

__all__ = [
    "ParamPiece", "ParamSpec", "Update", "Adapter",
    "SamplingParams", "GenerationRequest", "TokenEvent", "Generator",
]
