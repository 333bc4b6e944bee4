"""Where replay chunks live in a run's store, and reading them back (``docs/replay-format.md``)::

    runs/<run_id>/replay/<request key>/<writer>-<first position:012d>.srpl

``<request key>`` (:func:`request_key`) is the request id itself when it is 1-128 characters of
``[A-Za-z0-9._-]`` starting with a letter or digit, without ``..``, else ``h-`` + the first 32 hex digits of its
SHA-256 (the chunk holds the real id, and readers keep only chunks whose id matches). ``<writer>`` is 16 hex
digits per recorder. ``engine.replay.ReplayRecorder`` writes the chunks; :func:`read_request` reads every chunk
of a request (all writers) back and :func:`list_requests` lists a run's request keys.
"""

from __future__ import annotations

import hashlib
import re

from syncd import manifest as mf
from syncd.records.replay import ReplayChunk, ReplayFormatError, decode_chunk

__all__ = ["SUFFIX", "MAX_CHUNK_BYTES", "replay_prefix", "request_key", "chunk_key", "list_requests", "read_request"]

SUFFIX = ".srpl"
MAX_CHUNK_BYTES = 1 << 30
_SAFE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def replay_prefix(run_id: str) -> str:
    return f"{mf.run_prefix(run_id)}replay/"


def request_key(request_id: str) -> str:
    """The key component of ``request_id``: itself when it is 1-128 characters of ``[A-Za-z0-9._-]`` starting
    with a letter or digit, without ``..``; else ``h-`` + the first 32 hex digits of its SHA-256."""
    if _SAFE_ID.match(request_id) and ".." not in request_id:
        return request_id
    return "h-" + hashlib.sha256(request_id.encode("utf-8")).hexdigest()[:32]


def chunk_key(run_id: str, request_id: str, writer: str, first_position: int) -> str:
    """The store key of a chunk (``writer``: 16 hex digits per recorder)."""
    return f"{replay_prefix(run_id)}{request_key(request_id)}/{writer}-{first_position:012d}{SUFFIX}"


def list_requests(store, run_id: str) -> list[str]:
    """Request keys that have replay records in the run."""
    from syncd.store import Store

    store = Store.open(store)
    return sorted(store.list_dirs(replay_prefix(run_id)))


def read_request(store, run_id: str, request_id: str) -> list[ReplayChunk]:
    """Every chunk of ``request_id`` (all writers), decoded and sorted by first position. Raises
    ReplayFormatError for a corrupt chunk."""
    from syncd.store import Store

    store = Store.open(store)
    prefix = f"{replay_prefix(run_id)}{request_key(request_id)}/"
    chunks = []
    for o in store.list(prefix):
        if o.key.endswith(SUFFIX):
            data = store.get(o.key, limit=MAX_CHUNK_BYTES + 1)
            if len(data) > MAX_CHUNK_BYTES:
                raise ReplayFormatError(f"{o.key}: larger than {MAX_CHUNK_BYTES} bytes")
            chunks.append(decode_chunk(data))
    chunks = [c for c in chunks if c.request_id == request_id]
    return sorted(chunks, key=lambda c: c.first_position)
