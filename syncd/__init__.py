"""syncd: lossless weight deltas through object storage, applied in place by inference engines.

Public entry points are imported lazily so that ``import syncd`` stays cheap (no torch import until an op
is used).
"""

from __future__ import annotations

from syncd.lazy import lazy_names

__version__ = "0.1.0"

_LAZY = {
    "checksum": ("syncd.ops", "checksum"),
    "materialize": ("syncd.versions", "materialize"),
    "latest_version": ("syncd.versions", "latest_version"),
    "DeltaError": ("syncd.errors", "DeltaError"),
}

__all__ = sorted(_LAZY) + ["__version__"]


__getattr__ = lazy_names("syncd", _LAZY)
