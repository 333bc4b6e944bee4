"""An etcd server for simulated clusters (:class:`EtcdServer`): one member on the given address -- loopback, or
inside a network namespace (:class:`bench.netsim.Netns`) -- with its data in a directory of the caller's, so it can
be killed (SIGKILL) and started again on the same data: its leases and revisions survive, as on a real restart.
Debian's ``etcd-server`` (``scripts/setup_services.sh``) provides the binary, found by
:func:`syncd.engine.dynamo.services.find_binary` (which raises ``ServiceUnavailable`` naming the setup script when
it is missing). Used from one thread.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from bench.netsim.netns import free_port
from syncd.engine.dynamo.services import find_binary

__all__ = ["EtcdServer"]

_PROBE = "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=1).read()"


class EtcdServer:
    """etcd on ``host`` (ports picked free on loopback unless given). ``prefix``: an argv prefix to run it
    under (``ip netns exec NS``). :attr:`url` is its client URL. A context manager: stopped on exit."""

    def __init__(self, workdir, *, host: str = "127.0.0.1", client_port: int | None = None,
                 peer_port: int | None = None, prefix=()):
        self.workdir = Path(workdir)
        self.host = host
        self.client_port = client_port or free_port(host)
        self.peer_port = peer_port or free_port(host)
        self.prefix = list(prefix)
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.client_port}"

    def start(self, timeout_s: float = 30.0) -> "EtcdServer":
        """Start it (on the data of an earlier run, if any) and wait until it answers; raises ``RuntimeError``
        with the end of its log if it exits or does not answer within ``timeout_s``."""
        binary = find_binary("etcd")
        self.workdir.mkdir(parents=True, exist_ok=True)
        peer = f"http://{self.host}:{self.peer_port}"
        log = open(self.workdir / "etcd.log", "ab")
        try:
            self.proc = subprocess.Popen(
                [*self.prefix, binary, "--name", "simetcd", "--data-dir", str(self.workdir / "data"),
                 "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                 "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                 "--initial-cluster", f"simetcd={peer}", "--log-level", "error"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        finally:
            log.close()
        self.starts += 1
        deadline = time.monotonic() + timeout_s
        while not self.healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = (self.workdir / "etcd.log").read_text(errors="replace")[-2000:]
                self.kill()
                raise RuntimeError(f"etcd at {self.url} did not come up: {tail}")
            time.sleep(0.1)
        return self

    def healthy(self) -> bool:
        """Whether it answers ``/health`` now (asked from inside its namespace when it runs in one)."""
        if not self.prefix:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    return r.status == 200
            except OSError:
                return False
        probe = subprocess.run([*self.prefix, sys.executable, "-c", _PROBE, self.url + "/health"],
                               capture_output=True, timeout=10)
        return probe.returncode == 0

    def kill(self, sig=signal.SIGKILL) -> None:
        """Send ``sig`` (default SIGKILL) and wait for it to exit."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)

    def __enter__(self) -> "EtcdServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
