"""Network namespaces with shaped links (:class:`Netns`): one namespace per host behind a bridge in a switch
namespace, each host on its own veth pair; :meth:`Netns.shape` puts a ``tc tbf`` token bucket on both
directions of a host's link (egress of the host's end = its upload, egress of the switch's end = its download).
Needs root and ``ip``/``tc``; :meth:`Netns.close` removes every namespace it made (deleting a namespace deletes
its veths), and is safe to call after a failed setup. The addresses (``10.213.x.y``) exist only inside those
namespaces. Used from one thread.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess

from syncd.procs import free_port

__all__ = ["Lab", "Netns", "netns_available", "free_port"]


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


class Lab:
    """A context manager over ``start()`` and ``close()``: on entry ``start()``, and ``close()`` if it fails (so
    ``close`` must be safe after a partial start); on exit ``close()``."""

    def start(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _run(*cmd: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr.strip()}")


class Netns(Lab):
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

    def start(self) -> None:
        self.setup()

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

    def shape(self, host: str, rate_bps: float, *, up: bool = True, down: bool = True,
              burst_bytes: int | None = None, queue_ms: int = 200) -> None:
        """A ``tbf`` of ``rate_bps`` bits/s on the host's upload and/or download. ``burst_bytes``: what the link
        sends at once after an idle moment (default: one 64 KiB GSO packet or 10 ms of traffic, whichever is more;
        a smaller one -- down to a few packets -- keeps short transfers at the link's rate, and ``tbf`` splits
        bigger GSO packets). ``queue_ms``: the longest a packet waits in the link's queue before it is dropped."""
        rate = int(rate_bps)
        burst = burst_bytes if burst_bytes is not None else max(64 << 10, rate // 8 // 100)
        spec = ["root", "handle", "1:", "tbf", "rate", f"{rate}bit", "burst", str(burst), "latency", f"{queue_ms}ms"]
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
