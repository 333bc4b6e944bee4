"""Fixtures: real stores. A local file store in a temp dir, an in-memory store, and an S3-compatible server
(moto's server mode) started on a free loopback port by the tests themselves."""

from __future__ import annotations

import logging
import socket
import threading
import urllib.request
import uuid

import pytest

from syncd.store import RetryPolicy, Store

KEY = "test-signing-key-0123456789abcdef"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_endpoint():
    """URL of a moto S3 server on 127.0.0.1, for the whole session."""
    moto_server = pytest.importorskip("moto.server")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def s3_url(s3_endpoint, monkeypatch):
    """A fresh, empty bucket on the loopback S3 server, as an ``s3://`` URL; credentials in the env."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    bucket = f"b-{uuid.uuid4().hex[:12]}"
    # bucket creation is server setup, not data access: one plain HTTP request (moto needs no signature)
    urllib.request.urlopen(urllib.request.Request(f"{s3_endpoint}/{bucket}", method="PUT"), timeout=10).read()
    return f"s3://{bucket}/prefix"


@pytest.fixture(params=["file", "memory", "s3"])
def any_store(request, tmp_path):
    """The same tests on every backend the suite can run here."""
    if request.param == "file":
        return Store(tmp_path / "store", part_bytes=1 << 16)
    if request.param == "memory":
        return Store(f"memory://{uuid.uuid4().hex}", part_bytes=1 << 16)
    url = request.getfixturevalue("s3_url")
    return Store(url, part_bytes=1 << 16, retry=RetryPolicy(attempts=2, http_retries=2, retry_timeout_s=10))


class FlakyProxy:
    """A TCP proxy on loopback that resets the first ``drop`` connections, then forwards to ``target``."""

    def __init__(self, target_port: int, drop: int):
        self.target_port, self.drop, self.accepted = target_port, drop, 0
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self._stop = False
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            if self.accepted <= self.drop:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                conn.close()  # RST
                continue
            up = socket.create_connection(("127.0.0.1", self.target_port))
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src, dst):
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self):
        self._stop = True
        self.sock.close()
