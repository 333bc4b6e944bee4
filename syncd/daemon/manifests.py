"""Moved to :mod:`syncd.manifest_source` (the daemon and the cluster controller read manifests through the same
source); kept until 0.3: each name imported from here warns (DeprecationWarning) with its new path."""

from syncd.lazy import lazy_names

__all__ = ["ManifestSource", "reason_of"]

__getattr__ = lazy_names(__name__, {n: "syncd.manifest_source" for n in __all__}, deprecated=True)
