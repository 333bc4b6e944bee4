"""The replica server: what every owner runs to hold its peers' replicas and serve them back, and to serve the live
state a healing peer asks for (the protocol and its clients: :mod:`syncd.trainer.ft.replicas`).

* ``PUT /v1/replicas/<owner>/<step>``: a framed bundle, checked (owner, step, run, every hash) while it streams into
  a temporary folder, renamed into place only whole; the newest ``keep`` steps per owner are kept.
* ``GET /v1/replicas/<owner>`` lists the steps held (and each one's manifest digest);
  ``GET /v1/replicas/<owner>/<step>`` sends one back;
  ``GET /v1/heal/<step>`` the live state staged by :class:`syncd.trainer.ft.heal.VerifiedTransport`.
* Every request must present the job's token (:mod:`syncd.trainer.ft.replica_wire`): anything else is answered 401
  before a byte of its body is read, logged and counted (``unauthorized``, ``refused``).
* Every connection has a deadline (:func:`~syncd.trainer.ft.replica_wire.transfer_deadline`), and the one lock is
  held only around a rename and its retention, never while bytes move: a peer that trickles its upload holds up no
  other peer's.
* A holder killed mid-transfer leaves a temporary folder; the server removes such leftovers when it starts.
* :meth:`ReplicaServer.close` stops taking connections and lets the transfers in progress finish (each within its
  deadline) before it closes.

Thread-safety: the handlers run on their own threads; ``stage_heal``/``unstage_heal``/``close`` from any thread.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import shutil
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from syncd.trainer.ft.ckpt_dir import TMP_PREFIX, land_frame, list_steps, step_dir
from syncd.trainer.ft.ckpt_format import MANIFEST, StateError, check_owner, frame_prefix, manifest_digest
from syncd.trainer.ft.replica_wire import MIN_RATE, Deadline, authorized, transfer_deadline

log = logging.getLogger(__name__)

__all__ = ["ReplicaServer"]

_PATH = re.compile(r"^/v1/replicas(?:/([A-Za-z0-9][A-Za-z0-9._-]{0,63}))?(?:/(\d{1,18}))?$")
_HEAL = re.compile(r"^/v1/heal/(\d{1,18})$")
_IO_CHUNK = 8 << 20
_DISCARD_BYTES = 1 << 20  # of a refused request's body, read so that its sender sees the refusal


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:  # a peer that hung up (e.g. after a refusal)
        log.debug("replica server: connection from %s ended in an error", client_address, exc_info=True)


class ReplicaServer:
    """Holds replicas for other owners under ``root/<owner>/step-*`` and serves them (module docstring).
    ``keep``: steps kept per owner; ``max_bytes``: the largest replica accepted; ``token``: what every request
    must present (None: no authentication, for tests and tools only); ``run_id``: the run whose replicas it takes
    (None: any); ``timeout_s``/``min_rate``: each connection's deadline
    (:func:`~syncd.trainer.ft.replica_wire.transfer_deadline`)."""

    def __init__(self, root, *, host: str = "127.0.0.1", port: int = 0, keep: int = 2, signing_key=None,
                 max_bytes: int = 1 << 40, timeout_s: float = 120.0, token: str | None = None,
                 run_id: str | None = None, min_rate: float = MIN_RATE):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        _remove_partials(self.root)
        self.keep, self.signing_key, self.max_bytes = keep, signing_key, max_bytes
        self.token, self.run_id, self.timeout_s, self.min_rate = token, run_id, timeout_s, min_rate
        self.received = self.refused = self.unauthorized = 0
        self._heal: tuple[int, bytes] | None = None
        self._heal_lock = threading.Condition()
        self._heal_readers = 0
        self._lock = threading.Lock()  # renames and retention only; never held while bytes move
        self._active = 0
        self._active_cond = threading.Condition()
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

            def _authorized(self) -> bool:
                if authorized(self.headers.get("Authorization"), outer.token):
                    return True
                outer.unauthorized += 1
                outer.refused += 1
                log.warning("replica server: %s %s from %s refused: no valid job token", self.command,
                            self.path[:200], self.client_address[0])
                self.close_connection = True
                self._error(401, "this replica server needs the job's token (the replica secret: "
                                 "SYNCD_REPLICA_SECRET_FILE or <checkpoint-dir>/replica-secret)")
                self._discard_body()
                return False

            def _discard_body(self):
                """Read (and drop) a little of a refused request's body, at most 1 s: a peer still sending then
                reads the answer instead of a reset connection."""
                try:
                    left = min(int(self.headers.get("Content-Length") or 0), _DISCARD_BYTES)
                    with Deadline(self.connection, 1.0):
                        while left > 0 and (chunk := self.rfile.read1(min(left, 1 << 16))):
                            left -= len(chunk)
                except (OSError, ValueError):
                    pass

            def do_PUT(self):
                with outer._transfer():
                    if not self._authorized():
                        return
                    m = _PATH.match(self.path)
                    if not m or not m.group(1) or not m.group(2):
                        self.close_connection = True
                        return self._error(404, f"no such resource {self.path[:200]}")
                    try:
                        n = int(self.headers.get("Content-Length", ""))
                    except ValueError:
                        self.close_connection = True
                        return self._error(411, "Content-Length required")
                    limit = transfer_deadline(n, outer.timeout_s, outer.min_rate)
                    try:
                        with Deadline(self.connection, limit) as dl:
                            step = outer._receive(m.group(1), int(m.group(2)), self.rfile.read, n)
                    except StateError as exc:
                        outer.refused += 1
                        why = f"not received within its deadline of {limit:.0f} s" if dl.fired else str(exc)
                        log.warning("replica refused: %s", why)
                        self.close_connection = True
                        return self._error(400, why)
                    self._reply(201, json.dumps({"owner": m.group(1), "step": step}).encode())

            def do_GET(self):
                with outer._transfer():
                    if not self._authorized():
                        return
                    heal = _HEAL.match(self.path)
                    if heal:
                        return outer._send_heal(self, int(heal.group(1)))
                    m = _PATH.match(self.path)
                    if not m:
                        return self._error(404, f"no such resource {self.path[:200]}")
                    owner, step = m.group(1), m.group(2)
                    if owner and not step:
                        steps = list_steps(outer.root / owner)
                        return self._reply(200, json.dumps({"owner": owner, "steps": steps,
                                                            "manifests": _digests(outer.root / owner, steps)}).encode())
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

    @contextlib.contextmanager
    def _transfer(self):
        with self._active_cond:
            self._active += 1
        try:
            yield
        finally:
            with self._active_cond:
                self._active -= 1
                self._active_cond.notify_all()

    def close(self, timeout: float | None = None) -> None:
        """Stop taking connections, let the transfers in progress finish (at most ``timeout`` seconds; None: the
        server's ``timeout_s``), then close."""
        self._server.shutdown()
        deadline = time.monotonic() + (self.timeout_s if timeout is None else timeout)
        with self._active_cond:
            while self._active and time.monotonic() < deadline:
                self._active_cond.wait(0.05)
            if self._active:
                log.warning("replica server %s: closing with %d transfer(s) unfinished", self.url, self._active)
        self._server.server_close()

    # ------------------------------------------------------------------------------------ replicas

    def _receive(self, owner: str, step: int, read, length: int) -> int:
        owner = check_owner(owner)
        if length > self.max_bytes:
            raise StateError(f"replica of {owner} step {step}: {length} bytes, more than {self.max_bytes}")
        land_frame(read, length, self.root / owner, owner=owner, step=step, signing_key=self.signing_key,
                   run_id=self.run_id, max_bytes=self.max_bytes, where=f"replica of {owner} step {step}",
                   lock=self._lock, keep=self.keep)
        self.received += 1
        return step

    def _send_dir(self, handler, path: Path) -> None:
        raw = (path / MANIFEST).read_bytes()
        names = sorted(json.loads(raw)["files"])
        total = 8 + len(raw) + sum((path / n).stat().st_size for n in names)
        with Deadline(handler.connection, transfer_deadline(total, self.timeout_s, self.min_rate)):
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

    def _send_heal(self, handler, step: int) -> None:
        """The staged state of ``step``, waiting up to ``timeout_s`` for the sender to stage it (the healthy peer
        serializes it in its own quorum thread, at about the time the joiner asks)."""
        deadline = time.monotonic() + self.timeout_s
        with self._heal_lock:
            while (self._heal is None or self._heal[0] != step) and time.monotonic() < deadline:
                self._heal_lock.wait(0.05)
            staged = self._heal
            if staged is None or staged[0] != step:
                have = None if staged is None else staged[0]
                return handler._error(404, f"no healing state of step {step} staged (staged: {have})")
            self._heal_readers += 1
        try:
            with Deadline(handler.connection, transfer_deadline(len(staged[1]), self.timeout_s, self.min_rate)):
                handler._reply(200, staged[1], "application/octet-stream")
        finally:
            with self._heal_lock:
                self._heal_readers -= 1
                self._heal_lock.notify_all()


def _remove_partials(root: Path) -> None:
    """Temporary folders of transfers a killed holder never finished (``root/<owner>/.tmp-*``): never complete."""
    for d in [root, *(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(TMP_PREFIX))]:
        for tmp in d.glob(f"{TMP_PREFIX}*"):
            log.info("replica server: removing %s, left by a transfer that never finished", tmp)
            shutil.rmtree(tmp, ignore_errors=True)


def _digests(root: Path, steps: list[int]) -> dict[str, str]:
    """``{step: the SHA-256 of its manifest}`` for the held ``steps`` (one that vanished meanwhile is left out): what
    lets an owner see that a holder already has exactly its checkpoint."""
    out = {}
    for s in steps:
        try:
            out[str(s)] = manifest_digest((step_dir(root, s) / MANIFEST).read_bytes())
        except OSError:
            continue
    return out
