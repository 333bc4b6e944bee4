"""How replicas move between peers: the job's credential on every request, and a deadline on every connection.

* **Authentication**: every request to a :class:`syncd.trainer.ft.replicas.ReplicaServer` carries
  ``Authorization: Bearer <token>``, the token :func:`replica_token` derives from the job's secret and the run id
  (:mod:`syncd.trainer.ft.replica_secret` says where the secret comes from); the server compares it in constant
  time and answers anything else with 401 before it reads a byte of the body. A token never authenticates another
  run's transfers, even under the same secret.
* **Deadlines**: a peer that trickles bytes, or stops reading, must not hold a connection -- nor what waits on it --
  for ever. Each transfer of ``n`` bytes gets :func:`transfer_deadline` seconds in all (``timeout_s`` plus ``n``
  at :data:`MIN_RATE` bytes per second); :class:`Deadline` shuts the socket down when they are up, so a read or
  write blocked on the peer fails at once, on either side (``fired`` says it was the deadline).
* :func:`connect` opens the connection through the one HTTP client (:mod:`syncd.http_client`).

Thread-safety: the functions share nothing; a :class:`Deadline` belongs to one connection.
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import socket
import threading

from syncd import http_client

__all__ = ["ReplicaError", "MIN_RATE", "connect", "transfer_deadline", "Deadline", "replica_token", "auth_header",
           "authorized"]

#: the slowest transfer a replica connection is allowed, in bytes per second (8 MiB/s: a 10 GB checkpoint may take
#: 21 minutes, a trickle of a few bytes a second is cut off after ``timeout_s``)
MIN_RATE = 8 << 20


class ReplicaError(RuntimeError):
    """A peer could not take or give a replica (unreachable, refused, too slow, or what it sent did not verify)."""


def transfer_deadline(nbytes: int, timeout_s: float, min_rate: float = MIN_RATE) -> float:
    """Seconds a transfer of ``nbytes`` may take in all: ``timeout_s`` plus the bytes at ``min_rate``."""
    return timeout_s + max(0, nbytes) / min_rate


def connect(url: str, timeout_s: float) -> http.client.HTTPConnection:
    """A connection to the replica server at ``url`` (``http://host:port``), each read waiting at most
    ``timeout_s``; ReplicaError when it is not a replica server URL or nothing answers."""
    try:
        where = http_client.split_url(url, "replica server URL")
        if where.scheme != "http" or where.prefix:
            raise ValueError(f"replica server URL must be http://host:port, got {url[:200]!r}")
        return http_client.connect(where, connect_timeout_s=min(timeout_s, 10.0), timeout_s=timeout_s)
    except (ValueError, http_client.Unreachable) as exc:
        raise ReplicaError(str(exc)) from None


class Deadline:
    """Shuts ``sock`` down both ways ``seconds`` after entering (unless left first): whatever is blocked on it then
    fails at once. :meth:`reset` starts a new deadline from now; ``fired``: the deadline passed."""

    def __init__(self, sock, seconds: float):
        self.sock, self.seconds, self.fired = sock, seconds, False
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()

    def __enter__(self) -> Deadline:
        self.reset(self.seconds)
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def reset(self, seconds: float) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            self.seconds = seconds
            self._timer = threading.Timer(max(0.0, seconds), self._fire)
            self._timer.name = "replica-deadline"
            self._timer.daemon = True
            self._timer.start()

    def _fire(self) -> None:
        self.fired = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # already closed
            pass


def replica_token(secret: str, run_id: str) -> str:
    """The bearer token of run ``run_id``'s replica transfers under the job secret ``secret`` (hex)."""
    return hmac.new(secret.encode(), f"syncd replica transfer\n{run_id}".encode(), hashlib.sha256).hexdigest()


def auth_header(token: str | None) -> dict:
    """The request header carrying ``token`` (none without one)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def authorized(header: str | None, token: str | None) -> bool:
    """Whether a request's ``Authorization`` header presents ``token`` (always, where no token is required)."""
    if token is None:
        return True
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[len("Bearer "):].strip().encode(), token.encode())
