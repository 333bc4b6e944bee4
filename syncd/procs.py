"""Process helpers shared by the launchers, the service starters, the trainer, tests and benchmarks: a free port,
whether a port given on a command line is free (before anything slow starts), bounded waits, stopping a process, and a JSON call that can be polled (over :mod:`syncd.http_client`).

Everything here is bounded: every wait has a timeout and raises :class:`TimeoutError` saying what it was
waiting for; processes are stopped by their own pid (SIGTERM, then SIGKILL after a grace period).
Thread-safe (nothing shared).
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
from typing import Callable

from syncd import http_client

__all__ = ["free_port", "port_taken", "wait_until", "http_json", "stop_process", "wait_port"]


def free_port(host: str = "127.0.0.1", *, below: int | None = None) -> int:
    """A TCP port that was free on ``host`` a moment ago: the OS's pick, or with ``below`` a random free
    port in ``[10000, below]`` (for a server that takes only small port numbers, as Dynamo's system port)."""
    if below is None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            return s.getsockname()[1]
    rng = random.Random()
    for _ in range(200):
        port = rng.randint(10000, below)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port found in 10000..{below} on {host}")


def port_taken(host: str, port: int) -> str | None:
    """Why a server could not listen on ``host:port`` now (the OS's reason, e.g. "[Errno 98] Address already in
    use"), or None when it can. Port 0 (any free port) is never taken. A moment later another process may take
    the port: this lets a command name its flag at once instead of failing after a slow start."""
    if not port:
        return None
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT is no conflict
            s.bind((host, port))
    except OSError as exc:
        return str(exc)
    return None


def wait_until(predicate: Callable[[], object], timeout_s: float, what: str, *, interval_s: float = 0.1,
               alive: Callable[[], str | None] | None = None, not_yet: tuple[type[BaseException], ...] = ()):
    """Call ``predicate`` until it returns something truthy (returned) or ``timeout_s`` passes
    (:class:`TimeoutError` naming ``what``). ``alive()`` may return a reason to give up early (e.g. the
    process being waited for has exited), raised as :class:`RuntimeError`. An exception of a type in ``not_yet``
    from ``predicate`` counts as falsy (what it reads is not there yet, or half written)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            result = predicate()
        except not_yet:
            result = None
        if result:
            return result
        if alive is not None:
            reason = alive()
            if reason:
                raise RuntimeError(f"gave up waiting for {what}: {reason}")
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(interval_s)


def http_json(method: str, url: str, body: dict | None = None, *, timeout_s: float = 5.0) -> tuple[int, object]:
    """One HTTP request to the whole ``url`` with a JSON body; returns ``(status, parsed JSON or text)``. A server
    that cannot be reached gives ``(0, message)`` rather than raising, so it can be polled."""
    try:
        return http_client.request_json(method, url, obj=body, connect_timeout_s=timeout_s, timeout_s=timeout_s)
    except (http_client.Unreachable, http_client.ReplyTooLarge) as exc:
        return 0, str(exc)


def wait_port(host: str, port: int, timeout_s: float, what: str, **kw) -> None:
    """Wait until something accepts TCP connections on ``host:port``."""
    def connects():
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            return False

    wait_until(connects, timeout_s, what, **kw)


def stop_process(proc: subprocess.Popen, grace_s: float = 10.0, sig: int = signal.SIGTERM) -> int | None:
    """Send ``sig`` to ``proc`` (by its pid), wait up to ``grace_s``, then SIGKILL it. Returns its exit code
    (None if it could not be reaped). Safe to call on a process that already exited."""
    if proc.poll() is None:
        try:
            os.kill(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            try:
                os.kill(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                return None
    return proc.returncode
