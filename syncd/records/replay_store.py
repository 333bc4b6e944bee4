"""Where replay chunks live in a run's store, and reading them back (``docs/replay-format.md``)::

    runs/<run_id>/replay/<request key>/<writer>-<first position:012d>.srpl

``<request key>`` (:func:`request_key`) is the request id itself when it is 1-128 characters of
``[A-Za-z0-9._-]`` starting with a letter or digit, without ``..``, else ``h-`` + the first 32 hex digits of its
SHA-256 (the chunk holds the real id; a chunk under a request's key whose id is another is corrupt).
``<writer>`` is 16 hex digits per recorder. ``syncd.engine.replay.ReplayRecorder`` writes the chunks; :func:`read_request`
reads every chunk of a request (all writers) back, at most :data:`MAX_REQUEST_BYTES` of them in all, and
:func:`list_requests` lists a run's request keys.
"""

from __future__ import annotations

import hashlib
import re

from syncd import manifest as mf
from syncd.records.replay import ReplayChunk, ReplayFormatError, decode_chunk

__all__ = ["SUFFIX", "MAX_CHUNK_BYTES", "MAX_REQUEST_BYTES", "replay_prefix", "request_key", "chunk_key", "list_requests", "read_request"]

SUFFIX = ".srpl"
MAX_CHUNK_BYTES = 1 << 30
MAX_REQUEST_BYTES = 1 << 30  # every chunk of one request together (what one read_request may hold in memory)
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


def read_request(store, run_id: str, request_id: str, *, max_bytes: int = MAX_REQUEST_BYTES) -> list[ReplayChunk]:
    """Every chunk of ``request_id`` (all writers), decoded and sorted by first position. Raises
    ReplayFormatError for a corrupt chunk, a chunk under the request's key that holds another request's id,
    or chunks of more than ``max_bytes`` (:data:`MAX_REQUEST_BYTES`) in all."""
    from syncd.store import Store

    store = Store.open(store)
    prefix = f"{replay_prefix(run_id)}{request_key(request_id)}/"
    chunks, total = [], 0
    for o in store.list(prefix):
        if o.key.endswith(SUFFIX):
            limit = min(MAX_CHUNK_BYTES, max_bytes - total)
            data = store.get(o.key, limit=limit + 1)
            if len(data) > limit:
                what = (f"larger than {MAX_CHUNK_BYTES} bytes" if limit == MAX_CHUNK_BYTES else
                        f"past the {max_bytes} bytes one request's chunks may hold in all")
                raise ReplayFormatError(f"{o.key}: {what}")
            total += len(data)
            chunk = decode_chunk(data)
            if chunk.request_id != request_id:
                raise ReplayFormatError(f"{o.key}: a chunk of request {chunk.request_id[:200]!r} under the key of "
                                        f"request {request_id!r}")
            chunks.append(chunk)
    return sorted(chunks, key=lambda c: c.first_position)
