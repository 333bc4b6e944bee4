"""Errors of the cluster layer (:mod:`syncd.cluster`).

Everything a peer sends is hostile until checked; a peer that fails a check gets its connection closed and
the failure is counted (``ClusterNode.stats``). The exceptions below say what was wrong.
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
