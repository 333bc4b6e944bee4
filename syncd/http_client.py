"""One blocking HTTP/1.1 client for syncd's own calls to its own servers: an engine's control routes, a replica
server, the sandbox proxy, a Dynamo frontend, torchft's lighthouse. Each call is one short connection (nothing
goes stale when a server restarts), with a connect timeout apart from the reply timeout, and a bounded read.

* :func:`split_url` -- ``http(s)://host[:port][/prefix]`` into its parts, ``ValueError`` naming what is wrong;
* :func:`connect` -- a connected :class:`http.client.HTTPConnection` (for a caller that streams its body or its
  reply itself), :class:`Unreachable` when nothing answers;
* :func:`request` -- one whole exchange: a :class:`Reply` (status, headers, the body read up to a limit);
* :func:`request_json` -- the same with a JSON body, the reply parsed strictly (:mod:`syncd.jsonsafe`).

Errors: :class:`Unreachable` (a ``ConnectionError``) when the server cannot be reached, drops the connection or
does not answer within the timeout; :class:`ReplyTooLarge` when the reply is longer than ``max_reply_bytes``.
An HTTP error status is not an exception here: the caller decides what a status means.

Thread-safety: the functions share nothing; call them from any thread. (The cluster's etcd client is
asyncio-native and cancellable, so it speaks HTTP on its own event loop: :mod:`syncd.cluster.etcd_gateway`.)
"""

from __future__ import annotations

import http.client
import json
from dataclasses import dataclass
from urllib.parse import urlsplit

from syncd import jsonsafe
from syncd.errors import SyncdError

__all__ = ["Reply", "ReplyTooLarge", "Unreachable", "connect", "request", "request_json", "split_url"]

#: the most a reply may hold unless a caller says otherwise (bytes)
DEFAULT_MAX_REPLY_BYTES = 64 << 20


class Unreachable(SyncdError, ConnectionError):
    """The server could not be reached, dropped the connection, or did not answer in time."""


class ReplyTooLarge(SyncdError, ValueError):
    """A reply longer than the caller's limit (nothing of it is returned)."""


@dataclass(frozen=True)
class Url:
    scheme: str
    host: str
    port: int
    prefix: str  # the URL's path without its trailing "/", prepended to every request path

    @property
    def base(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}{self.prefix}"


@dataclass(frozen=True)
class Reply:
    status: int
    headers: dict  # lower-case names
    body: bytes


def split_url(url: str, what: str = "URL") -> Url:
    """``url`` (``http://`` or ``https://``, a host, an optional port and path) in parts; ``ValueError`` naming
    ``what`` and the value otherwise."""
    u = urlsplit(url) if isinstance(url, str) else None
    if u is None or u.scheme not in ("http", "https") or not u.hostname or u.query or u.fragment:
        raise ValueError(f"{what} must be http://host[:port][/path] (or https://), got {str(url)[:200]!r}")
    try:
        port = u.port or (443 if u.scheme == "https" else 80)
    except ValueError:
        raise ValueError(f"{what} has an invalid port: {url[:200]!r}") from None
    return Url(u.scheme, u.hostname, port, u.path.rstrip("/"))


def connect(url: str | Url, *, connect_timeout_s: float = 5.0, timeout_s: float = 30.0
            ) -> http.client.HTTPConnection:
    """A connection to ``url``'s server, connected within ``connect_timeout_s`` and then waiting at most
    ``timeout_s`` for each read (:class:`Unreachable` if it cannot connect). The caller closes it."""
    where = url if isinstance(url, Url) else split_url(url)
    cls = http.client.HTTPSConnection if where.scheme == "https" else http.client.HTTPConnection
    conn = cls(where.host, where.port, timeout=connect_timeout_s)
    try:
        conn.connect()
    except OSError as exc:
        conn.close()
        raise Unreachable(f"{where.base} is not answering: {type(exc).__name__}: {exc}") from None
    conn.sock.settimeout(timeout_s)
    return conn


def request(method: str, url: str | Url, path: str = "", *, body: bytes | None = None, headers: dict | None = None,
            connect_timeout_s: float = 5.0, timeout_s: float = 30.0,
            max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES) -> Reply:
    """One ``method`` request for ``path`` (appended to the URL's own path) with ``body``; the whole reply.
    Raises :class:`Unreachable` or :class:`ReplyTooLarge` (see the module docstring)."""
    where = url if isinstance(url, Url) else split_url(url)
    conn = connect(where, connect_timeout_s=connect_timeout_s, timeout_s=timeout_s)
    try:
        try:
            conn.request(method, f"{where.prefix}{path}", body=body, headers=headers or {})
            resp = conn.getresponse()
            raw = resp.read(max_reply_bytes + 1)
        except (OSError, http.client.HTTPException) as exc:
            raise Unreachable(f"{where.base}{path}: {method} failed: {type(exc).__name__}: {exc}") from None
        if len(raw) > max_reply_bytes:
            raise ReplyTooLarge(f"{where.base}{path}: the reply is over {max_reply_bytes} bytes")
        return Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, raw)
    finally:
        conn.close()


def request_json(method: str, url: str | Url, path: str = "", obj=None, *, headers: dict | None = None,
                 connect_timeout_s: float = 5.0, timeout_s: float = 30.0,
                 max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES, max_depth: int = 16) -> tuple[int, object]:
    """:func:`request` with ``obj`` sent as JSON (none when ``None``); ``(status, reply)`` where ``reply`` is the
    strictly parsed JSON, ``None`` for an empty body, or the first 300 characters of a body that is not JSON
    (a server's plain-text error). Raises as :func:`request` does."""
    body = None if obj is None else json.dumps(obj).encode()
    reply = request(method, url, path, body=body,
                    headers={"Content-Type": "application/json", "Accept": "application/json", **(headers or {})},
                    connect_timeout_s=connect_timeout_s, timeout_s=timeout_s, max_reply_bytes=max_reply_bytes)
    if not reply.body:
        return reply.status, None
    try:
        return reply.status, jsonsafe.loads(reply.body, what=f"the reply of {path or '/'}",
                                            max_bytes=max_reply_bytes, max_depth=max_depth)
    except jsonsafe.JSONError:
        return reply.status, reply.body[:300].decode("utf-8", "replace")
