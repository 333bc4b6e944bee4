"""Exceptions raised by syncd.

Every error that comes from bad input (a blob, a manifest, a message from a peer) is a subclass of
:class:`SyncdError`; the ones about data are also ``ValueError`` so that callers that only know the
standard library still catch them.
"""


class SyncdError(Exception):
    """Base class of every error syncd raises on purpose."""


class DeltaError(SyncdError, ValueError):
    """A delta blob is malformed, corrupt, or does not fit the tensor it is applied to.

    Raised by :mod:`syncd.ops.delta`. When it is raised by ``apply_`` the target tensor is unchanged.
    """


class BackendUnavailable(SyncdError, RuntimeError):
    """A backend was asked for by name but cannot run here; the message says why."""


# --- object store, manifests and versions (syncd.store, syncd.manifest, syncd.versions, syncd.publish.publisher) ---


class StoreError(SyncdError, OSError):
    """A storage operation failed (after the transient-error retries); the message names the store and key."""


class ObjectNotFound(StoreError):
    """An object that was asked for by key is not in the store."""


class ObjectExists(StoreError):
    """A create-if-absent put found an object already at that key; nothing was written."""


class ObjectTooLarge(SyncdError, ValueError):
    """An object in the store is larger than the reader accepts (``Store.get_bounded``); its body was not
    read. The message names the store, the key and both sizes."""


class ManifestError(SyncdError, ValueError):
    """A manifest is malformed: not strict JSON, not canonical, a field of the wrong type or out of bounds,
    or inconsistent with itself. Nothing in it was used."""


class SignatureError(ManifestError):
    """A manifest's HMAC signature is missing while a signing key is configured, or does not match the
    configured key (the manifest was altered, or signed with another key)."""


class ManifestMismatch(ManifestError):
    """A correctly signed manifest was found where it does not belong: its signed run id or version differs
    from the key it was read from (a replayed or copied manifest), or it does not chain to its base."""


class IntegrityError(SyncdError, ValueError):
    """Data from the store does not match its manifest: a shard's size or SHA-256, or a tensor's dtype,
    shape or checksum. Raised before anything from that data is applied."""


class VersionNotFound(SyncdError, LookupError):
    """The requested version (or any version, for a run with none) has no manifest in the store."""


class BaseVersionMissing(VersionNotFound):
    """A delta version cannot be materialized because a version in its base chain is gone from the store."""


class VersionConflict(SyncdError, RuntimeError):
    """Another publisher already committed this version number of the run; this publisher's upload lost."""


class PublishError(SyncdError, RuntimeError):
    """A background encode or upload of :class:`syncd.trainer.WeightPublisher` failed; ``__cause__`` says why."""


# --- engine control (syncd.engines.control, the node daemon) ---


class NotAuthorized(SyncdError, PermissionError):
    """An engine-control request did not present the node's engine token (``syncd.engine_token``)."""


class LeaseHeld(SyncdError, RuntimeError):
    """An engine refused a weight-control request because another controller holds its lease; the message
    names that controller's run and pid and when the lease expires."""
