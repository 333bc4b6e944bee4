"""Local etcd and NATS servers for Dynamo's production-style discovery path (``--discovery etcd``).

Debian's ``etcd-server`` and ``nats-server`` packages provide the binaries (``scripts/setup_services.sh``
installs them). :class:`LocalServices` starts one of each on free loopback ports with their data in a
directory of the caller's, waits until both answer, and stops them (by pid) on :meth:`close` or when used as
a context manager. Used by ``syncd.engine.dynamo.serve --start-services``, the tests and the benchmarks.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path

from syncd.procs import free_port, http_json, stop_process, wait_port, wait_until

log = logging.getLogger(__name__)

__all__ = ["LocalServices", "ServiceUnavailable", "find_binary"]

_SEARCH = ("/usr/bin", "/usr/sbin", "/usr/local/bin", "/usr/local/sbin")


class ServiceUnavailable(RuntimeError):
    """etcd or nats-server is not installed (run ``scripts/setup_services.sh``) or did not start."""


def find_binary(name: str) -> str:
    """Path of ``name`` on PATH or in the usual system folders; raises :class:`ServiceUnavailable`."""
    found = shutil.which(name) or next((str(Path(d, name)) for d in _SEARCH if Path(d, name).is_file()), None)
    if found is None:
        raise ServiceUnavailable(f"{name} is not installed; run scripts/setup_services.sh (Debian packages "
                                 "etcd-server and nats-server)")
    return found


class LocalServices:
    """An etcd and a NATS server on loopback (see the module docstring). ``workdir``: their data and logs.
    Attributes once started: ``etcd_endpoints`` (``http://127.0.0.1:P``) and ``nats_server``
    (``nats://127.0.0.1:P``). Not thread-safe; one owner starts and stops it."""

    def __init__(self, workdir: str | os.PathLike, *, host: str = "127.0.0.1", timeout_s: float = 30.0):
        self.workdir = Path(workdir)
        self.host = host
        self.timeout_s = timeout_s
        self.etcd: subprocess.Popen | None = None
        self.nats: subprocess.Popen | None = None
        self.etcd_endpoints: str | None = None
        self.nats_server: str | None = None

    def start(self) -> "LocalServices":
        etcd_bin, nats_bin = find_binary("etcd"), find_binary("nats-server")
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            self._start_etcd(etcd_bin)
            self._start_nats(nats_bin)
        except BaseException:
            self.close()
            raise
        return self

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        logf = open(self.workdir / f"{name}.log", "ab")
        try:
            return subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        finally:
            logf.close()

    def _exited(self, proc: subprocess.Popen, name: str):
        def check():
            if proc.poll() is not None:
                tail = (self.workdir / f"{name}.log").read_text(errors="replace")[-2000:]
                return f"{name} exited with status {proc.returncode}: {tail}"
            return None
        return check

    def _start_etcd(self, binary: str) -> None:
        client, peer = free_port(self.host), free_port(self.host)
        url = f"http://{self.host}:{client}"
        self.etcd = self._spawn("etcd", [
            binary, "--name", "syncd", "--data-dir", str(self.workdir / "etcd-data"),
            "--listen-client-urls", url, "--advertise-client-urls", url,
            "--listen-peer-urls", f"http://{self.host}:{peer}",
            "--initial-advertise-peer-urls", f"http://{self.host}:{peer}",
            "--initial-cluster", f"syncd=http://{self.host}:{peer}", "--log-level", "error"])
        wait_until(lambda: http_json("GET", f"{url}/health", timeout_s=1)[0] == 200, self.timeout_s,
                   f"etcd at {url}", alive=self._exited(self.etcd, "etcd"))
        self.etcd_endpoints = url
        log.info("etcd serving at %s (pid %d)", url, self.etcd.pid)

    def _start_nats(self, binary: str) -> None:
        port = free_port(self.host)
        self.nats = self._spawn("nats", [binary, "-a", self.host, "-p", str(port), "-js",
                                         "-sd", str(self.workdir / "nats-data")])
        wait_port(self.host, port, self.timeout_s, f"nats-server on {self.host}:{port}",
                  alive=self._exited(self.nats, "nats"))
        self.nats_server = f"nats://{self.host}:{port}"
        log.info("nats-server serving at %s (pid %d)", self.nats_server, self.nats.pid)

    def close(self) -> None:
        """Stop both servers (SIGTERM, then SIGKILL after 10 s)."""
        for proc in (self.nats, self.etcd):
            if proc is not None:
                stop_process(proc, 10)
        self.nats = self.etcd = None

    def __enter__(self) -> "LocalServices":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
