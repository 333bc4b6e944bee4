"""An S3 endpoint over a ``file://`` store directory (:class:`S3FileServer`, ``python -m bench.netsim
s3serve``): path-style GET with ranges, HEAD, conditional GET, ListObjectsV2; it logs the bytes of every object
it sends -- the store reads that crossed the long link, counted at the store (:func:`read_store_log`). Read-only
unless made ``writable``: then single-request PUT (``If-None-Match: *`` for create-if-absent, 412 when the key
exists) and DELETE too, so a publisher can write to it over a shaped link; multipart uploads are refused (501:
give the writer's ``Store`` a ``part_bytes`` above its largest object). Writes are atomic (a hidden temporary
file renamed or linked into place) and not logged. Each request is handled on its own thread.
"""

from __future__ import annotations

import email.utils
import json
import logging
import os
import re
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit
from xml.sax.saxutils import escape, unescape

log = logging.getLogger(__name__)

__all__ = ["S3FileServer", "read_store_log", "s3_env"]


class _S3Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers then sendfile: no 40 ms wait for the reader's delayed ACK
    server: "S3FileServer"

    def log_message(self, fmt, *args):  # quiet
        pass

    def _path(self):
        parts = urlsplit(self.path)
        segs = unquote(parts.path).lstrip("/").split("/", 1)
        bucket = segs[0]
        key = segs[1] if len(segs) > 1 else ""
        return bucket, key, parse_qs(parts.query, keep_blank_values=True)

    def _file(self, key: str) -> Path | None:
        if not key or ".." in key.split("/") or key.startswith("/"):
            return None
        p = self.server.root / key
        return p if p.is_file() else None

    @staticmethod
    def _etag(st) -> str:
        return f'"{st.st_mtime_ns:x}-{st.st_size:x}-{st.st_ino:x}"'

    def _error(self, code: int, s3code: str) -> None:
        body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{s3code}</Code>'
                f"<Message>{s3code}</Message></Error>").encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        if self.command in ("PUT", "POST"):  # a request body we may not have read: no reuse of the connection
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_HEAD(self):
        self.do_GET()

    def do_PUT(self):
        bucket, key, q = self._path()
        if not self.server.writable:
            return self._error(403, "AccessDenied")
        if bucket != self.server.bucket:
            return self._error(404, "NoSuchBucket")
        if "uploadId" in q or "partNumber" in q:
            return self._error(501, "NotImplemented")
        dest = self._target(key)
        if dest is None:
            return self._error(400, "InvalidArgument")
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n) if n else b""
        if len(body) != n:
            return self._error(400, "IncompleteBody")
        create = self.headers.get("If-None-Match", "").strip() == "*"
        if not self.server.write(dest, body, create=create):
            return self._error(412, "PreconditionFailed")
        self.send_response(200)
        self.send_header("ETag", self._etag(dest.stat()))
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self):
        """DeleteObjects (``POST /bucket?delete``); multipart uploads are not implemented (501)."""
        bucket, _, q = self._path()
        if not self.server.writable:
            return self._error(403, "AccessDenied")
        if bucket != self.server.bucket or "delete" not in q:
            return self._error(501, "NotImplemented")
        n = int(self.headers.get("Content-Length") or 0)
        keys = [unescape(k) for k in re.findall(r"<Key>(.*?)</Key>", self.rfile.read(n).decode())]
        for key in keys:
            dest = self._target(key)
            if dest is not None:
                dest.unlink(missing_ok=True)
        body = ('<?xml version="1.0" encoding="UTF-8"?><DeleteResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
                + "".join(f"<Deleted><Key>{escape(k)}</Key></Deleted>" for k in keys) + "</DeleteResult>").encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_DELETE(self):
        bucket, key, _ = self._path()
        if not self.server.writable:
            return self._error(403, "AccessDenied")
        dest = self._target(key) if bucket == self.server.bucket else None
        if dest is not None:
            dest.unlink(missing_ok=True)
        self.send_response(204)
        self.end_headers()

    def _target(self, key: str) -> Path | None:
        """Where object ``key`` is written: under the root, no ``..``, no hidden path part."""
        parts = key.split("/")
        if not key or key.startswith("/") or any(p in ("", ".", "..") or p.startswith(".") for p in parts):
            return None
        return self.server.root.joinpath(*parts)

    def do_GET(self):
        bucket, key, q = self._path()
        if bucket != self.server.bucket:
            return self._error(404, "NoSuchBucket")
        if not key and "list-type" in q:
            return self._list(q)
        f = self._file(key)
        if f is None:
            return self._error(404, "NoSuchKey")
        st = f.stat()
        etag = self._etag(st)
        if self.headers.get("If-None-Match") == etag:
            self.send_response(304)
            self.send_header("ETag", etag)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        size, start, end, code = st.st_size, 0, st.st_size, 200
        rng = self.headers.get("Range")
        if rng:
            m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng.strip())
            if not m or int(m.group(1)) >= size:
                return self._error(416, "InvalidRange")
            start = int(m.group(1))
            end = min(size, int(m.group(2)) + 1) if m.group(2) else size
            code = 206
        self.send_response(code)
        self.send_header("Content-Length", str(end - start))
        self.send_header("ETag", etag)
        self.send_header("Last-Modified", email.utils.formatdate(st.st_mtime, usegmt=True))
        self.send_header("Accept-Ranges", "bytes")
        if code == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()
        if self.command == "HEAD":
            return
        sent = 0
        try:
            with open(f, "rb") as fh:
                off, left = start, end - start
                while left > 0:
                    n = os.sendfile(self.connection.fileno(), fh.fileno(), off, min(left, 1 << 20))
                    if n == 0:
                        break
                    off, left, sent = off + n, left - n, sent + n
        finally:  # a reader that died mid-body still cost what was sent
            self.server.record(key, sent, self.client_address[0])

    def _list(self, q):
        prefix = q.get("prefix", [""])[0]
        delim = q.get("delimiter", [""])[0]
        root = self.server.root
        base = root / prefix.rsplit("/", 1)[0] if "/" in prefix else root
        keys, prefixes = [], set()
        if base.is_dir():
            for dirpath, _dirs, files in os.walk(base):
                for name in files:
                    rel = os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/")
                    if not rel.startswith(prefix) or "/." in "/" + rel:
                        continue
                    rest = rel[len(prefix):]
                    if delim and delim in rest:
                        prefixes.add(prefix + rest.split(delim, 1)[0] + delim)
                    else:
                        keys.append(rel)
        parts = [f'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
                 f"<Name>{escape(self.server.bucket)}</Name><Prefix>{escape(prefix)}</Prefix>"
                 f"<KeyCount>{len(keys) + len(prefixes)}</KeyCount><MaxKeys>100000</MaxKeys>"
                 "<IsTruncated>false</IsTruncated>"]
        for k in sorted(keys):
            st = (root / k).stat()
            lm = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(st.st_mtime))
            parts.append(f"<Contents><Key>{escape(k)}</Key><LastModified>{lm}</LastModified>"
                         f"<ETag>{escape(self._etag(st))}</ETag><Size>{st.st_size}</Size>"
                         "<StorageClass>STANDARD</StorageClass></Contents>")
        for p in sorted(prefixes):
            parts.append(f"<CommonPrefixes><Prefix>{escape(p)}</Prefix></CommonPrefixes>")
        parts.append("</ListBucketResult>")
        body = "".join(parts).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class S3FileServer(ThreadingHTTPServer):
    """Serves directory ``root`` as bucket ``bucket`` on ``(host, port)``. Every object body sent is
    appended to ``log_path`` as ``{"key", "bytes", "peer", "t"}`` (a JSON line) when given; ``bytes`` counts
    what was handed to the kernel, also when the reader went away before the end (then some of it may never
    have left this host); ``peer`` is the reader's address. ``writable``: accept PUT and DELETE (see the
    module docstring)."""

    daemon_threads = True

    def __init__(self, root, host: str, port: int, *, bucket: str = "simstore", log_path=None,
                 writable: bool = False):
        self.root, self.bucket, self.writable = Path(root).resolve(), bucket, writable
        self._log = open(log_path, "a", buffering=1) if log_path else None
        self._lock = threading.Lock()
        super().__init__((host, port), _S3Handler)

    def write(self, dest: Path, body: bytes, *, create: bool) -> bool:
        """Put ``body`` at ``dest`` atomically; with ``create`` only if nothing is there (False then)."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.parent / f".put-{os.getpid()}-{threading.get_ident()}-{time.monotonic_ns()}"
        tmp.write_bytes(body)
        try:
            if not create:
                os.replace(tmp, dest)
                return True
            try:
                os.link(tmp, dest)  # fails if dest exists: create-if-absent without a race
            except FileExistsError:
                return False
            return True
        finally:
            tmp.unlink(missing_ok=True)

    def handle_error(self, request, client_address) -> None:
        if isinstance(sys.exc_info()[1], ConnectionError):  # a reader killed mid-request: not a server error
            log.debug("s3 client %s went away", client_address)
            return
        super().handle_error(request, client_address)

    def record(self, key: str, n: int, peer: str | None = None) -> None:
        if self._log is not None:
            with self._lock:
                self._log.write(json.dumps({"key": key, "bytes": n, "peer": peer, "t": time.time()}) + "\n")


def read_store_log(path) -> list[dict]:
    try:
        with open(path) as fh:
            return [json.loads(line) for line in fh if line.strip()]
    except FileNotFoundError:
        return []


def s3_env() -> dict:
    """Environment for processes that read the simulated S3 endpoint (dummy credentials)."""
    return {"AWS_ACCESS_KEY_ID": "sim", "AWS_SECRET_ACCESS_KEY": "sim", "AWS_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true"}


# ---------------------------------------------------------------------------------------------- node processes
