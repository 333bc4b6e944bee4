"""Peer replicas of the per-step checkpoints: every owner's newest checkpoint copied to ``k`` peers on other
nodes, verified by hash on arrival and again on the way back, so that a replaced or restarted rank rebuilds its
state from its peers (seconds) instead of the object store.

**Placement** (:func:`place_replicas`): owners are grouped by node; owner ``i`` on node ``n`` sends its replicas to
one owner on each of the ``k`` nodes that follow ``n`` in a ring of the distinct nodes (the owner with the same
index on that node, modulo its size). The ``k`` holders are on ``k`` distinct nodes, none of them ``n``: one node's
death never takes a checkpoint together with all its replicas (``k >= 1``), and every owner holds about ``k``
replicas. ``k`` larger than the number of other nodes is a configuration error.

**Transport**: every owner runs a :class:`ReplicaServer` (stdlib ``ThreadingHTTPServer``, bound where
``host`` says; loopback by default). A replica moves as one framed :mod:`syncd.trainer.ft.ckpt_format` bundle: the
manifest (each file's size and SHA-256, HMAC-signed with the run's key when one is set), then the raw file bytes.
``PUT /v1/replicas/<owner>/<step>`` stores one (:func:`push_replica`): the holder checks the manifest, streams the
files into a temporary folder while hashing them, and renames the folder into place only if every hash matched;
it keeps the newest ``keep`` steps per owner. ``GET /v1/replicas/<owner>`` lists the steps held,
``GET /v1/replicas/<owner>/<step>`` sends one back, checked again by :func:`fetch_replica` before it lands in the
owner's own checkpoint folder. ``GET /v1/heal/<step>`` serves the state staged by
:class:`syncd.trainer.ft.heal.VerifiedTransport`.
Why not torchft's own checkpoint transports: both unpickle what they receive (``torch.load(weights_only=False)``,
``pickle.loads`` of the metadata), HTTPTransport serves live tensors by reference, and PGTransport needs the peer
in lockstep on the training process group with fixed tags; the same bundle format is used for their job
(``syncd.trainer.ft.heal``) so only hash-checked safetensors and bounded JSON are ever parsed.

Where the peers are, the replicator that pushes every durable checkpoint, and the rebuild of a lost owner from
its holders are in :mod:`syncd.trainer.ft.peers`.

Thread-safety: the server's handlers run on their own threads; the functions are stateless.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import re
import shutil
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

from syncd import jsonsafe
from syncd.trainer.ft.checkpoint import list_steps, parse_checkpoint, step_dir
from syncd.trainer.ft.ckpt_format import MANIFEST, StateError, check_owner, frame_prefix, read_frame

log = logging.getLogger(__name__)

__all__ = ["place_replicas", "ReplicaServer", "push_replica", "fetch_replica", "fetch_checkpoint", "write_bundle",
           "list_replicas", "ReplicaError"]

_PATH = re.compile(r"^/v1/replicas(?:/([A-Za-z0-9][A-Za-z0-9._-]{0,63}))?(?:/(\d{1,18}))?$")
_HEAL = re.compile(r"^/v1/heal/(\d{1,18})$")
_IO_CHUNK = 8 << 20


class ReplicaError(RuntimeError):
    """A peer could not take or give a replica (unreachable, refused, or what it sent did not verify)."""


def place_replicas(nodes: list[str], k: int) -> list[list[int]]:
    """For each owner ``i`` (on node ``nodes[i]``) the owners that hold its ``k`` replicas (module docstring)."""
    distinct = list(dict.fromkeys(nodes))
    if k < 0:
        raise ValueError(f"the replica count k must be >= 0, got {k}")
    if k > len(distinct) - 1:
        raise ValueError(f"{k} replicas need {k + 1} nodes; the owners are on {len(distinct)} "
                         f"({', '.join(distinct)})")
    on = {n: [i for i, m in enumerate(nodes) if m == n] for n in distinct}
    out = []
    for i, n in enumerate(nodes):
        j, local = distinct.index(n), on[n].index(i)
        out.append([on[distinct[(j + d) % len(distinct)]][local % len(on[distinct[(j + d) % len(distinct)]])]
                    for d in range(1, k + 1)])
    return out


# ---------------------------------------------------------------------------------------------- server


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:  # a peer that hung up (e.g. after a refusal)
        log.debug("replica server: connection from %s ended in an error", client_address, exc_info=True)


class ReplicaServer:
    """Holds replicas for other owners under ``root/<owner>/step-*`` and serves them (module docstring).
    ``keep``: steps kept per owner; ``max_bytes``: the largest replica accepted."""

    def __init__(self, root, *, host: str = "127.0.0.1", port: int = 0, keep: int = 2, signing_key=None,
                 max_bytes: int = 1 << 40, timeout_s: float = 120.0):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep, self.signing_key, self.max_bytes = keep, signing_key, max_bytes
        self.received = self.refused = 0
        self._heal: tuple[int, bytes] | None = None
        self._heal_lock = threading.Condition()
        self._heal_readers = 0
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = timeout_s

            def log_message(self, fmt, *args):
                log.debug("replica server: " + fmt, *args)

            def _reply(self, code: int, body: bytes, ctype="application/json"):
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _error(self, code: int, msg: str):
                self._reply(code, json.dumps({"error": msg[:2000]}).encode())

            def do_PUT(self):
                m = _PATH.match(self.path)
                if not m or not m.group(1) or not m.group(2):
                    return self._error(404, f"no such resource {self.path[:200]}")
                try:
                    n = int(self.headers.get("Content-Length", ""))
                except ValueError:
                    return self._error(411, "Content-Length required")
                try:
                    step = outer._receive(m.group(1), int(m.group(2)), self.rfile.read, n)
                except StateError as exc:
                    outer.refused += 1
                    log.warning("replica refused: %s", exc)
                    self.close_connection = True
                    return self._error(400, str(exc))
                self._reply(201, json.dumps({"owner": m.group(1), "step": step}).encode())

            def do_GET(self):
                heal = _HEAL.match(self.path)
                if heal:
                    return outer._send_heal(self, int(heal.group(1)), timeout_s)
                m = _PATH.match(self.path)
                if not m:
                    return self._error(404, f"no such resource {self.path[:200]}")
                owner, step = m.group(1), m.group(2)
                if owner and not step:
                    return self._reply(200, json.dumps({"owner": owner,
                                                        "steps": list_steps(outer.root / owner)}).encode())
                if not (owner and step):
                    return self._error(404, "GET /v1/replicas/<owner>[/<step>]")
                path = step_dir(outer.root / owner, int(step))
                if not (path / MANIFEST).is_file():
                    return self._error(404, f"no replica of {owner} step {step}")
                outer._send_dir(self, path)

        self._server = _QuietServer((host, port), Handler)
        self._server.daemon_threads = True
        self.url = f"http://{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="replica-server", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    # ------------------------------------------------------------------------------------ replicas

    def _receive(self, owner: str, step: int, read, length: int) -> int:
        owner = check_owner(owner)
        if length > self.max_bytes:
            raise StateError(f"replica of {owner} step {step}: {length} bytes, more than {self.max_bytes}")
        with self._lock:
            _land(read, length, self.root / owner, owner=owner, step=step, signing_key=self.signing_key,
                  max_bytes=self.max_bytes, where=f"replica of {owner} step {step}")
            for s in list_steps(self.root / owner)[self.keep:]:
                shutil.rmtree(step_dir(self.root / owner, s), ignore_errors=True)
        self.received += 1
        return step

    def _send_dir(self, handler, path: Path) -> None:
        raw = (path / MANIFEST).read_bytes()
        names = sorted(json.loads(raw)["files"])
        total = 8 + len(raw) + sum((path / n).stat().st_size for n in names)
        handler.send_response(200)
        handler.send_header("Content-Type", "application/octet-stream")
        handler.send_header("Content-Length", str(total))
        handler.end_headers()
        handler.wfile.write(frame_prefix(raw) + raw)
        for n in names:
            with open(path / n, "rb") as f:
                shutil.copyfileobj(f, handler.wfile, _IO_CHUNK)

    # ------------------------------------------------------------------------------------ live healing state

    def stage_heal(self, step: int, frame: bytes) -> None:
        """Serve ``frame`` (a framed bundle) at ``GET /v1/heal/<step>`` until :meth:`unstage_heal`."""
        with self._heal_lock:
            self._heal = (step, frame)
            self._heal_lock.notify_all()

    def unstage_heal(self, timeout: float | None = None) -> None:
        """Stop serving the staged state, after the transfers in progress have finished."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._heal_lock:
            while self._heal_readers and (deadline is None or time.monotonic() < deadline):
                self._heal_lock.wait(0.1)
            self._heal = None

    def _send_heal(self, handler, step: int, timeout_s: float) -> None:
        """The staged state of ``step``, waiting up to ``timeout_s`` for the sender to stage it (the healthy peer
        serializes it in its own quorum thread, at about the time the joiner asks)."""
        deadline = time.monotonic() + timeout_s
        with self._heal_lock:
            while (self._heal is None or self._heal[0] != step) and time.monotonic() < deadline:
                self._heal_lock.wait(0.05)
            staged = self._heal
            if staged is None or staged[0] != step:
                have = None if staged is None else staged[0]
                return handler._error(404, f"no healing state of step {step} staged (staged: {have})")
            self._heal_readers += 1
        try:
            handler._reply(200, staged[1], "application/octet-stream")
        finally:
            with self._heal_lock:
                self._heal_readers -= 1
                self._heal_lock.notify_all()


# ---------------------------------------------------------------------------------------------- clients


def _conn(url: str, timeout_s: float) -> http.client.HTTPConnection:
    u = urlsplit(url)
    if u.scheme != "http" or not u.hostname or not u.port:
        raise ReplicaError(f"not a replica server URL: {url[:200]!r}")
    return http.client.HTTPConnection(u.hostname, u.port, timeout=timeout_s)


def push_replica(url: str, path, *, owner: str, step: int, timeout_s: float = 120.0) -> None:
    """Send the checkpoint folder ``path`` (owner ``owner``, step ``step``) to the replica server at ``url``;
    ReplicaError if it is unreachable or refuses it (the message carries the holder's reason)."""
    path = Path(path)
    raw = (path / MANIFEST).read_bytes()
    names = sorted(json.loads(raw)["files"])
    total = 8 + len(raw) + sum((path / n).stat().st_size for n in names)
    conn = _conn(url, timeout_s)
    try:
        conn.putrequest("PUT", f"/v1/replicas/{check_owner(owner)}/{int(step)}")
        conn.putheader("Content-Type", "application/octet-stream")
        conn.putheader("Content-Length", str(total))
        conn.endheaders()
        conn.send(frame_prefix(raw) + raw)
        for n in names:
            with open(path / n, "rb") as f:
                while chunk := f.read(_IO_CHUNK):
                    conn.send(chunk)
        resp = conn.getresponse()
        body = resp.read(1 << 16)
        if resp.status != 201:
            raise ReplicaError(f"{url} refused the replica of {owner} step {step}: HTTP {resp.status} "
                               f"{body[:500].decode('utf-8', 'replace')}")
    except OSError as exc:
        raise ReplicaError(f"{url}: replica of {owner} step {step} not sent: {type(exc).__name__}: {exc}") from None
    finally:
        conn.close()


def list_replicas(url: str, owner: str, *, timeout_s: float = 10.0) -> list[int]:
    """Steps of ``owner`` the server at ``url`` holds, newest first; ReplicaError when it cannot say."""
    conn = _conn(url, timeout_s)
    try:
        conn.request("GET", f"/v1/replicas/{check_owner(owner)}")
        resp = conn.getresponse()
        raw = resp.read(1 << 20)
        if resp.status != 200:
            raise ReplicaError(f"{url}: HTTP {resp.status} listing replicas of {owner}")
        doc = jsonsafe.loads(raw, what=f"{url} replica listing", max_bytes=1 << 20, max_depth=3, floats=False,
                             error=ReplicaError)
        steps = doc.get("steps") if isinstance(doc, dict) else None
        if not isinstance(steps, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                                  for s in steps):
            raise ReplicaError(f"{url}: malformed replica listing of {owner}")
        return sorted(steps, reverse=True)
    except OSError as exc:
        raise ReplicaError(f"{url}: {type(exc).__name__}: {exc}") from None
    finally:
        conn.close()


def _land(read, length, root: Path, *, owner: str, step: int, signing_key, max_bytes: int, where: str) -> Path:
    """Stream one framed bundle into ``root/step-<step>``: a temporary folder while every file is hashed against
    the manifest, renamed into place only when all matched (StateError otherwise; nothing is left behind)."""
    final = step_dir(root, step)
    tmp = root / f".tmp-{final.name}-{os.getpid()}-{threading.get_ident()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    files: dict = {}

    def sink(name, chunk):
        if name not in files:
            files[name] = open(tmp / name, "wb")
        files[name].write(chunk)

    try:
        bundle = read_frame(read, length, where=where, signing_key=signing_key, owner=owner, step=step,
                            max_bytes=max_bytes, sink=sink)
        for name in bundle.manifest["files"]:
            if name not in files:  # an empty file: no chunk was handed over
                files[name] = open(tmp / name, "wb")
        for f in files.values():
            f.flush()
            os.fsync(f.fileno())
            f.close()
        (tmp / MANIFEST).write_bytes(bundle.raw_manifest)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        return final
    finally:
        for f in files.values():
            f.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _pull(url: str, owner: str, step: int, timeout_s: float, receive):
    """``receive(response, length, where)`` on the body of ``GET /v1/replicas/<owner>/<step>``; its result."""
    where = f"replica of {owner} step {step} from {url}"
    conn = _conn(url, timeout_s)
    try:
        conn.request("GET", f"/v1/replicas/{check_owner(owner)}/{int(step)}")
        resp = conn.getresponse()
        if resp.status != 200:
            raise ReplicaError(f"{url}: HTTP {resp.status} for the replica of {owner} step {step}: "
                               f"{resp.read(2000).decode('utf-8', 'replace')}")
        length = resp.headers.get("Content-Length")
        return receive(resp, int(length) if length and length.isdigit() else None, where)
    except OSError as exc:
        raise ReplicaError(f"{url}: replica of {owner} step {step}: {type(exc).__name__}: {exc}") from None
    finally:
        conn.close()


def fetch_replica(url: str, owner: str, step: int, dest_root, *, signing_key=None, timeout_s: float = 120.0,
                  max_bytes: int = 1 << 40) -> Path:
    """Fetch ``owner``'s replica of ``step`` from ``url`` into ``dest_root/step-<step>`` (atomic), every file
    verified against the manifest on the way; StateError if it does not verify, ReplicaError if unreachable."""
    return _pull(url, owner, step, timeout_s, lambda resp, length, where: _land(
        resp.read, length, Path(dest_root), owner=owner, step=step, signing_key=signing_key, max_bytes=max_bytes,
        where=where))


def fetch_checkpoint(url: str, owner: str, step: int, *, signing_key=None, timeout_s: float = 120.0,
                     max_bytes: int = 1 << 40):
    """``owner``'s replica of ``step`` from ``url``, verified (every hash) and parsed in memory, never touching the
    disk: ``(bundle, checkpoint)``; :func:`write_bundle` persists the bundle. StateError / ReplicaError."""
    def receive(resp, length, where):
        bundle = read_frame(resp.read, length, where=where, signing_key=signing_key, owner=owner, step=step,
                            max_bytes=max_bytes, readinto=resp.readinto)
        return bundle, parse_checkpoint(bundle, where)

    return _pull(url, owner, step, timeout_s, receive)


def write_bundle(bundle, root) -> Path:
    """Write a verified in-memory bundle to ``root/step-<step>`` atomically (files fsynced, the manifest last,
    renamed into place)."""
    root = Path(root)
    final = step_dir(root, bundle.step)
    tmp = root / f".tmp-{final.name}-{os.getpid()}-{threading.get_ident()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for name, data in [*sorted(bundle.files.items()), (MANIFEST, bundle.raw_manifest)]:
            with open(tmp / name, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        return final
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
