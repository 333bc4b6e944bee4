"""Dynamo's own rule for the ports syncd gives it."""

from __future__ import annotations

__all__ = ["MAX_SYSTEM_PORT"]

#: Dynamo 1.6 parses DYN_SYSTEM_PORT as a signed 16-bit number: a worker's system port must be below this
#: (``syncd.procs.free_port(below=MAX_SYSTEM_PORT)``).
MAX_SYSTEM_PORT = 32767
