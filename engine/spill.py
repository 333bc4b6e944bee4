"""Spill files: what the object store refused, kept on the local disk until it takes it, so that a process killed
before the store comes back loses nothing (the proxy's trajectory records, ``syncd.engine.proxy.writer``; the replay
recorder's chunks, ``syncd.engine.replay.recorder``). A spill file is written create-if-absent and whole or not at
all: a temporary file beside it, synced, then linked into place.

Thread-safety: the functions share nothing (blocking: call them from a worker thread in an event loop)."""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

__all__ = ["spill", "unspill"]


def spill(path: Path, data: bytes) -> bool:
    """Write ``data`` at ``path`` (its folders made) unless a file is there: True when ``path`` holds ``data``
    (written now, or those bytes were there already), False when it holds other bytes (nothing written). OSError
    when the disk refuses."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "xb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.link(tmp, path)  # create-if-absent, whole file or nothing
        except FileExistsError:
            return path.read_bytes() == data
        return True
    finally:
        tmp.unlink(missing_ok=True)


def unspill(path: Path | None, what: str, log: logging.Logger) -> None:
    """The store has ``what``: remove its spill file ``path`` (None: it has none); one that cannot be removed stays,
    logged on ``log``."""
    if path is not None:
        try:
            path.unlink()
        except OSError as exc:
            log.warning("%s is in the store; its spill file %s stays: %s", what, path, exc)
