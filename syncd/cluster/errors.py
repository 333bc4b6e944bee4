"""Errors of the cluster layer (:mod:`syncd.cluster`).

Everything a peer (or etcd) sends is hostile until checked; a peer that fails a check gets its connection closed
and the failure is counted (``ClusterNode.stats``). The exceptions below say what was wrong.
"""

from __future__ import annotations

from syncd.errors import SyncdError


class ClusterError(SyncdError, RuntimeError):
    """Base class of the errors of :mod:`syncd.cluster`."""


class AuthError(ClusterError):
    """A peer failed the mutual challenge/response with the cluster secret, or a frame's MAC does not verify
    (the connection was not opened by a member of the cluster, or its bytes were altered in transit)."""


class ProtocolError(ClusterError, ValueError):
    """A peer sent something malformed: an unknown frame type, a length over the bound of its type, a
    message that does not parse or whose fields are out of range, or a frame out of order."""


class NotHeld(ClusterError):
    """The peer asked for a shard does not hold it and does not expect to (try another source)."""


class Stalled(ClusterError):
    """A source made no progress within the configured bound; the receiver moves to another source.
    ``peer_starved``: the source itself had nothing more (it waits on its own upstream)."""

    def __init__(self, msg: str, *, peer_starved: bool = False):
        super().__init__(msg)
        self.peer_starved = peer_starved


class EtcdError(ClusterError):
    """etcd answered a call with an error, or the call could not be made (see the subclasses). The message
    names the endpoint and the call; ``reason`` is etcd's own message, when it sent one."""

    def __init__(self, msg: str, *, reason: str | None = None):
        super().__init__(msg)
        self.reason = reason


class EtcdUnavailable(EtcdError):
    """etcd could not be reached, did not answer in time, or cannot serve now (no quorum): try again later."""


class LeaseNotFound(EtcdError):
    """The etcd lease named in the call does not exist (it expired or was revoked)."""


class EtcdProtocolError(EtcdError, ProtocolError):
    """An etcd reply that does not follow the HTTP or JSON API (malformed, oversized, a field missing or out
    of range)."""
