"""Moved to :mod:`syncd.manifest_source` (the daemon and the cluster controller read manifests through the same
source); re-exported here, kept for one release."""

from syncd.manifest_source import ManifestSource, reason_of  # noqa: F401

__all__ = ["ManifestSource", "reason_of"]
