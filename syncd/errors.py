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
