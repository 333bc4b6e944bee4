"""Simulated clusters for tests and benchmarks: node processes, network namespaces with shaped links, and
a read-only S3 endpoint over a file store.

* :class:`Netns`: one network namespace per host behind a bridge in a switch namespace, each host on its own
  veth pair; :meth:`Netns.shape` puts a ``tc tbf`` token bucket on both directions of a host's link (egress
  of the host's end = its upload, egress of the switch's end = its download). Needs root and ``ip``/``tc``;
  :meth:`Netns.close` removes every namespace it made (deleting a namespace deletes its veths), and is safe to
  call after a failed setup. The addresses (``10.213.x.y``) exist only inside those namespaces.
* :class:`S3FileServer` / ``python -m syncd.cluster.sim s3serve``: serves a ``file://`` store directory as
  an S3 bucket (path-style GET with ranges, HEAD, conditional GET, ListObjectsV2), read-only, and logs the
  bytes of every object it sends -- the store reads that crossed the long link, counted at the store.
* :class:`NodeProcs`: starts ``python -m syncd.cluster.node`` processes (optionally inside namespaces),
  kills (SIGKILL) and restarts them, and reads their event logs.

Used from one thread; the S3 server handles each request on its own thread.
"""

from __future__ import annotations

import argparse
import email.utils
import json
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit
from xml.sax.saxutils import escape

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def netns_available() -> str | None:
    """None if network namespaces can be made here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    name = "syncdprobe" + secrets.token_hex(3)
    r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if r.returncode != 0:
        return f"ip netns add failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def _run(*cmd: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr.strip()}")


class Netns:
    """``hosts`` namespaces on one bridge. Host ``i`` is namespace :meth:`ns` ``(i)`` with address
    :meth:`ip` ``(i)`` on interface ``eth0``. Use as a context manager (always cleaned up)."""

    def __init__(self, hosts: list[str], *, subnet: int | None = None):
        self.tag = secrets.token_hex(2)
        self.names = list(hosts)
        self.subnet = subnet if subnet is not None else 16 + secrets.randbelow(200)
        self.switch = f"sy{self.tag}sw"
        self.made: list[str] = []

    def ns(self, host: str) -> str:
        return f"sy{self.tag}{host}"

    def ip(self, host: str) -> str:
        return f"10.213.{self.subnet}.{10 + self.names.index(host)}"

    def exec_prefix(self, host: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns(host)]

    def __enter__(self) -> "Netns":
        try:
            self.setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def setup(self) -> None:
        _run("ip", "netns", "add", self.switch)
        self.made.append(self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        for i, h in enumerate(self.names):
            ns = self.ns(h)
            _run("ip", "netns", "add", ns)
            self.made.append(ns)
            a, b = f"sy{self.tag}{i}a", f"sy{self.tag}{i}b"
            _run("ip", "link", "add", a, "type", "veth", "peer", "name", b)
            _run("ip", "link", "set", a, "netns", ns)
            _run("ip", "link", "set", b, "netns", self.switch)
            _run("ip", "-n", ns, "link", "set", a, "name", "eth0")
            _run("ip", "-n", self.switch, "link", "set", b, "name", f"p{i}")
            _run("ip", "-n", ns, "addr", "add", f"{self.ip(h)}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", self.switch, "link", "set", f"p{i}", "master", "br0")
            _run("ip", "-n", self.switch, "link", "set", f"p{i}", "up")

    def shape(self, host: str, rate_bps: float, *, up: bool = True, down: bool = True) -> None:
        """A ``tbf`` of ``rate_bps`` bits/s on the host's upload and/or download."""
        rate = int(rate_bps)
        burst = max(64 << 10, rate // 8 // 100)  # >= one GSO packet, ~10 ms of traffic
        spec = ["root", "tbf", "rate", f"{rate}bit", "burst", str(burst), "latency", "200ms"]
        i = self.names.index(host)
        if up:
            _run("ip", "netns", "exec", self.ns(host), "tc", "qdisc", "replace", "dev", "eth0", *spec)
        if down:
            _run("ip", "netns", "exec", self.switch, "tc", "qdisc", "replace", "dev", f"p{i}", *spec)

    def unshape(self, host: str) -> None:
        i = self.names.index(host)
        subprocess.run(["ip", "netns", "exec", self.ns(host), "tc", "qdisc", "del", "dev", "eth0", "root"],
                       capture_output=True)
        subprocess.run(["ip", "netns", "exec", self.switch, "tc", "qdisc", "del", "dev", f"p{i}", "root"],
                       capture_output=True)

    def tx_bytes(self, host: str) -> int:
        """Bytes the host has sent on its link (kernel counter)."""
        out = subprocess.run(["ip", "netns", "exec", self.ns(host), "cat", "/sys/class/net/eth0/statistics/tx_bytes"],
                             capture_output=True, text=True).stdout
        return int(out.strip() or 0)

    def close(self) -> None:
        for ns in reversed(self.made):
            r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            for pid in r.stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.made.clear()


# ---------------------------------------------------------------------------------------------- S3 over files


class _S3Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "S3FileServer"

    def log_message(self, fmt, *args):  # quiet
        pass

    def _path(self):
        parts = urlsplit(self.path)
        segs = unquote(parts.path).lstrip("/").split("/", 1)
        bucket = segs[0]
        key = segs[1] if len(segs) > 1 else ""
        return bucket, key, parse_qs(parts.query)

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
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_HEAD(self):
        self.do_GET()

    def do_PUT(self):
        self._error(403, "AccessDenied")

    def do_DELETE(self):
        self._error(403, "AccessDenied")

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
    have left this host); ``peer`` is the reader's address."""

    daemon_threads = True

    def __init__(self, root, host: str, port: int, *, bucket: str = "simstore", log_path=None):
        self.root, self.bucket = Path(root).resolve(), bucket
        self._log = open(log_path, "a", buffering=1) if log_path else None
        self._lock = threading.Lock()
        super().__init__((host, port), _S3Handler)

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


class NodeProcs:
    """Node processes of one simulated cluster. ``addrs``: ``{rank: (host, port)}``; ``prefix``:
    ``{rank: argv prefix}`` (e.g. ``ip netns exec NS``); ``args``: extra flags for every node."""

    def __init__(self, workdir, *, store: str, run_id: str, secret: str, signing_key: str | None,
                 addrs: dict, prefix: dict | None = None, args=(), env: dict | None = None,
                 log_level: str = "WARNING", discovery: str | None = None):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.addrs, self.prefix = dict(addrs), dict(prefix or {})
        self.secret_file = self.workdir / "cluster.secret"
        self.secret_file.write_text(secret)
        self.env = {**os.environ, **(env or {})}
        if signing_key:
            self.env["SYNCD_SIGNING_KEY"] = signing_key
        self.env.pop("SYNCD_CLUSTER_SECRET", None)
        self.discovery = discovery
        members = (["--peers-from-store", discovery] if discovery else
                   ["--peers", ",".join(f"{r}={h}:{p}" for r, (h, p) in sorted(self.addrs.items()))])
        self.common = ["--store", store, "--run-id", run_id, "--cluster-secret-file", str(self.secret_file),
                       *members, "--log-level", log_level, *args]
        self.procs: dict[int, subprocess.Popen] = {}
        self.extra: dict[int, list] = {}

    def cache(self, rank: int) -> Path:
        return self.workdir / f"node{rank}"

    def events_path(self, rank: int) -> Path:
        return self.workdir / f"node{rank}.events"

    def start(self, rank: int, extra=()) -> subprocess.Popen:
        self.extra[rank] = list(extra) or self.extra.get(rank, [])
        argv = [*self.prefix.get(rank, []), sys.executable, "-m", "syncd.cluster.node", *self.common,
                "--rank", str(rank), "--cache-root", str(self.cache(rank)), "--events", str(self.events_path(rank)),
                *self.extra[rank]]
        if self.discovery:
            argv += ["--advertise", "%s:%d" % self.addrs[rank]]
        errf = open(self.workdir / f"node{rank}.log", "ab")
        p = subprocess.Popen(argv, env=self.env, stdout=errf, stderr=errf, stdin=subprocess.DEVNULL)
        errf.close()
        self.procs[rank] = p
        return p

    def start_all(self) -> None:
        for r in sorted(self.addrs):
            self.start(r)

    def kill(self, rank: int, sig=signal.SIGKILL) -> None:
        p = self.procs.get(rank)
        if p is not None and p.poll() is None:
            p.send_signal(sig)
            p.wait(10)

    def stop_all(self) -> None:
        for r in list(self.procs):
            self.kill(r, signal.SIGTERM)

    def alive(self, rank: int) -> bool:
        p = self.procs.get(rank)
        return p is not None and p.poll() is None

    def events(self, rank: int, ev: str | None = None) -> list[dict]:
        out = []
        try:
            with open(self.events_path(rank)) as fh:
                for line in fh:
                    if line.endswith("\n"):
                        d = json.loads(line)
                        if ev is None or d["ev"] == ev:
                            out.append(d)
        except FileNotFoundError:
            pass
        return out

    def delivered(self, rank: int) -> list[int]:
        return [e["v"] for e in self.events(rank, "delivered")]

    def wait(self, pred, timeout: float, what: str, poll: float = 0.05):
        """Poll ``pred()`` until truthy (returned) or raise ``TimeoutError`` naming ``what``; also fails
        at once if a node that should be running died."""
        deadline = time.monotonic() + timeout
        while True:
            got = pred()
            if got:
                return got
            for r, p in self.procs.items():
                if p.poll() is not None and p.returncode not in (-9, -15, 0):
                    raise RuntimeError(f"node {r} exited with {p.returncode}: see {self.workdir}/node{r}.log")
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
            time.sleep(poll)

    def log_tail(self, rank: int, n: int = 4000) -> str:
        try:
            return (self.workdir / f"node{rank}.log").read_text()[-n:]
        except FileNotFoundError:
            return ""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m syncd.cluster.sim")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("s3serve", help="serve a file store directory as a read-only S3 bucket")
    s.add_argument("root")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=0)
    s.add_argument("--bucket", default="simstore")
    s.add_argument("--log", default=None, help="append a JSON line per object body sent")
    s.add_argument("--ready", default=None, help="write the bound port here once listening")
    a = p.parse_args(argv)
    srv = S3FileServer(a.root, a.host, a.port, bucket=a.bucket, log_path=a.log)
    if a.ready:
        tmp = a.ready + ".tmp"
        Path(tmp).write_text(str(srv.server_address[1]))
        os.replace(tmp, a.ready)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=srv.shutdown).start())
    srv.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
