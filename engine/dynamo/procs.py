"""Dynamo's own rule for the ports syncd gives it, and the check that a port given on a command line is free before
anything slow starts."""

from __future__ import annotations

import socket

__all__ = ["MAX_SYSTEM_PORT", "port_taken"]

#: Dynamo 1.6 parses DYN_SYSTEM_PORT as a signed 16-bit number: a worker's system port must be below this
#: (``syncd.procs.free_port(below=MAX_SYSTEM_PORT)``).
MAX_SYSTEM_PORT = 32767


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
