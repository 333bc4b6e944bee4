"""One HTTP/1.1 exchange with etcd's JSON gateway (:class:`Exchange`), for the client :mod:`syncd.cluster.etcd`:
a ``POST`` of a JSON body on a connection of its own (``Connection: close``), and its reply -- one JSON object, or
a stream of them (newline-delimited, chunked) -- read bounded and parsed strictly.

Bounds: the status line and each header, chunk-size or trailer line at most :data:`MAX_LINE` bytes, at most
:data:`MAX_HEADERS` header (or trailer) lines, a body or a streamed message at most ``max_reply_bytes``; the JSON
through :func:`syncd.cluster.wire.parse_json` (no floats, no duplicate members, depth 16). What breaks them raises
:class:`~syncd.cluster.errors.EtcdProtocolError`; a connection that fails or ends early raises
:class:`~syncd.cluster.errors.EtcdUnavailable`; an error reply raises what :func:`error_for` says. Every message
names the endpoint and the call.

Long exchanges (a campaign, an observation) set TCP keepalives, so a connection that silently died (a peer
rebooted, a partition that outlived it) is noticed within seconds. One task uses an :class:`Exchange`.
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
from dataclasses import dataclass
from urllib.parse import urlsplit

from syncd.cluster import wire
from syncd.cluster.errors import EtcdError, EtcdProtocolError, EtcdUnavailable, LeaseNotFound, ProtocolError

__all__ = ["Endpoint", "Exchange", "MAX_HEADERS", "MAX_LINE", "error_for", "parse_endpoints"]

MAX_LINE = 8192
MAX_HEADERS = 64
#: gRPC status codes etcd answers with when it cannot serve now (deadline exceeded, unavailable)
_RETRYABLE_CODES = (4, 14)


@dataclass(frozen=True)
class Endpoint:
    """One etcd client URL: ``http://host:port`` or ``https://host:port``."""

    scheme: str
    host: str
    port: int
    url: str


def parse_endpoints(text: str) -> list[Endpoint]:
    """``"http://a:2379,http://b:2379"`` -> endpoints; ``ValueError`` naming what is wrong."""
    out = []
    for url in filter(None, (u.strip() for u in str(text).split(","))):
        u = urlsplit(url)
        try:
            port = u.port or 2379
        except ValueError:
            port = None
        if u.scheme not in ("http", "https") or not u.hostname or port is None or u.path not in ("", "/") or u.query:
            raise ValueError(f"etcd endpoint {url!r} is not http(s)://HOST:PORT")
        out.append(Endpoint(u.scheme, u.hostname, port, url.rstrip("/")))
    if not out:
        raise ValueError("no etcd endpoint given")
    return out


def error_for(status: int, obj: dict, where: str) -> EtcdError:
    """The exception of an error reply ``obj`` (etcd's ``{"error", "message", "code"}``)."""
    reason = obj.get("message") or obj.get("error")
    reason = str(reason)[:300] if reason else None
    code = obj.get("code")
    text = f"{where}: {reason or f'HTTP {status}'}" + (f" (code {code})" if isinstance(code, int) else "")
    if reason and "lease not found" in reason:
        return LeaseNotFound(text, reason=reason)
    if code in _RETRYABLE_CODES or status in (502, 503, 504):
        return EtcdUnavailable(text, reason=reason)
    return EtcdError(text, reason=reason)


class Exchange:
    """A connection to ``endpoint`` for one call (open it with :meth:`open`; :meth:`close` it)."""

    def __init__(self, endpoint: Endpoint, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *,
                 max_reply_bytes: int):
        self.endpoint, self.reader, self.writer = endpoint, reader, writer
        self.max_reply_bytes = max_reply_bytes

    @classmethod
    async def open(cls, endpoint: Endpoint, *, timeout_s: float, long: bool, max_reply_bytes: int) -> "Exchange":
        """Connect within ``timeout_s`` (raises :class:`EtcdUnavailable`); ``long``: set TCP keepalives."""
        ctx = ssl.create_default_context() if endpoint.scheme == "https" else None
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(endpoint.host, endpoint.port, ssl=ctx, limit=MAX_LINE), timeout_s)
        except (OSError, asyncio.TimeoutError) as exc:
            raise EtcdUnavailable(f"etcd at {endpoint.url}: cannot connect: {type(exc).__name__}: {exc}") from None
        sock = writer.get_extra_info("socket")
        if long and sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            for opt, v in (("TCP_KEEPIDLE", 2), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 3)):
                if hasattr(socket, opt):
                    sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), v)
        return cls(endpoint, reader, writer, max_reply_bytes=max_reply_bytes)

    def where(self, path: str) -> str:
        return f"etcd at {self.endpoint.url}: {path}"

    def close(self) -> None:
        self.writer.close()

    async def unary(self, path: str, body: dict) -> dict:
        """POST ``body`` to ``path``; the reply object (an error reply raises)."""
        status, headers = await self._send(path, body)
        raw = await self._whole(headers, path)
        if status != 200:
            raise error_for(status, self._error_object(raw, path), self.where(path))
        return self._parse(raw, path)

    async def stream(self, path: str, body: dict):
        """POST ``body`` to ``path``; async iterator of the reply's messages as they arrive (an error reply, or an
        error message in the stream, raises)."""
        status, headers = await self._send(path, body)
        if status != 200:
            raise error_for(status, self._error_object(await self._whole(headers, path), path), self.where(path))
        buf = b""
        async for piece in self._pieces(headers, path):
            buf += piece
            while b"\n" in buf:
                line, _, buf = buf.partition(b"\n")
                if line.strip():
                    yield self._message(line, status, path)
            if len(buf) > self.max_reply_bytes:
                raise EtcdProtocolError(f"{self.where(path)}: a streamed message over {self.max_reply_bytes} bytes")
        if buf.strip():
            yield self._message(buf, status, path)

    # ------------------------------------------------------------------------------------- reading

    def _message(self, line: bytes, status: int, path: str) -> dict:
        obj = self._parse(line, path)
        if "error" in obj:
            raise error_for(status, obj["error"] if isinstance(obj["error"], dict) else obj, self.where(path))
        return obj

    def _parse(self, raw: bytes, path: str) -> dict:
        try:
            return wire.parse_json(raw, self.where(path), max_bytes=self.max_reply_bytes)
        except ProtocolError as exc:
            raise EtcdProtocolError(str(exc)) from None

    def _error_object(self, raw: bytes, path: str) -> dict:
        try:
            return self._parse(raw, path)
        except EtcdProtocolError:
            return {}

    async def _send(self, path: str, body: dict) -> tuple[int, dict]:
        data = json.dumps(body).encode()
        host = self.endpoint.host if ":" not in self.endpoint.host else f"[{self.endpoint.host}]"
        self.writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}:{self.endpoint.port}\r\n"
                          f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
                          f"Connection: close\r\n\r\n".encode() + data)
        try:
            await self.writer.drain()
            status_line = await self._line()
            parts = status_line.split(b" ", 2)
            if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit() or len(parts[1]) != 3:
                raise EtcdProtocolError(f"{self.where(path)}: not an HTTP reply: {status_line[:80]!r}")
            headers: dict[str, str] = {}
            while line := await self._line():
                if len(headers) >= MAX_HEADERS or b":" not in line:
                    raise EtcdProtocolError(f"{self.where(path)}: too many or malformed header lines")
                k, v = line.split(b":", 1)
                headers[k.strip().lower().decode("latin-1")] = v.strip().decode("latin-1")
        except asyncio.LimitOverrunError:
            raise EtcdProtocolError(f"{self.where(path)}: a status or header line over {MAX_LINE} bytes") from None
        except (OSError, asyncio.IncompleteReadError) as exc:
            raise EtcdUnavailable(f"{self.where(path)}: connection failed: {type(exc).__name__}: {exc}") from None
        return int(parts[1]), headers

    async def _line(self) -> bytes:
        return (await self.reader.readuntil(b"\n")).rstrip(b"\r\n")

    async def _whole(self, headers: dict, path: str) -> bytes:
        raw = b""
        async for piece in self._pieces(headers, path):
            raw += piece
            if len(raw) > self.max_reply_bytes:
                raise EtcdProtocolError(f"{self.where(path)}: a reply over {self.max_reply_bytes} bytes")
        return raw

    async def _pieces(self, headers: dict, path: str):
        """The body's bytes as they arrive (chunked, sized, or up to the end of the connection)."""
        try:
            if headers.get("transfer-encoding", "").lower() == "chunked":
                while True:
                    size = (await self._line()).split(b";")[0].strip()
                    if not size or len(size) > 8 or any(c not in b"0123456789abcdefABCDEF" for c in size):
                        raise EtcdProtocolError(f"{self.where(path)}: malformed chunk size {size[:20]!r}")
                    n = int(size, 16)
                    if n == 0:
                        for _ in range(MAX_HEADERS):  # trailers, then the empty line
                            if not await self._line():
                                return
                        raise EtcdProtocolError(f"{self.where(path)}: too many trailer lines")
                    if n > self.max_reply_bytes:
                        raise EtcdProtocolError(f"{self.where(path)}: a chunk of {n} bytes")
                    data = await self.reader.readexactly(n)
                    if await self.reader.readexactly(2) != b"\r\n":
                        raise EtcdProtocolError(f"{self.where(path)}: a chunk not followed by CRLF")
                    yield data
            elif "content-length" in headers:
                n = headers["content-length"]
                if not n.isdigit() or int(n) > self.max_reply_bytes:
                    raise EtcdProtocolError(f"{self.where(path)}: Content-Length {n[:20]!r} over the bound")
                yield await self.reader.readexactly(int(n))
            else:
                while data := await self.reader.read(self.max_reply_bytes + 1):
                    yield data
        except asyncio.LimitOverrunError:
            raise EtcdProtocolError(f"{self.where(path)}: a chunk or trailer line over {MAX_LINE} bytes") from None
        except (OSError, asyncio.IncompleteReadError) as exc:
            raise EtcdUnavailable(f"{self.where(path)}: reply cut short: {type(exc).__name__}: {exc}") from None
