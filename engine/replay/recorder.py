"""``ReplayRecorder``: collect every generated token's replay record per request and write them to the run's
object store prefix. Reading them back is :mod:`syncd.records.replay_store`'s (``read_request``,
``list_requests``).

Keys (``docs/replay-format.md``)::

    runs/<run_id>/replay/<request key>/<writer>-<first position:012d>.srpl

``<request key>`` is the request id itself when it is 1-128 characters of ``[A-Za-z0-9._-]`` starting with a
letter or digit, else ``h-`` + the first 32 hex digits of its SHA-256 (the chunk holds the real id).
``<writer>`` is 16 random hex digits per recorder, so two engines that serve the same request (a migrated
one) never write the same key; ``<first position>`` is the absolute position of the chunk's first token.
Objects are written with create-if-absent and never overwritten.

Kept sets: with ``kept_tolerance`` (the recorder's ``delta``, stated in every chunk) a set whose ranking is robust
(the sampler's margins, ``kept_margins``, exceed ``2 * delta``) is written for the trainer to rebuild from its own
logits (its size and a 32-bit fingerprint, a few bytes); the others, and every set of a writer without margins,
are listed. Without a tolerance (the default) every set is listed: a trainer can rebuild sets only from logits of
the weights that sampled them (``docs/trainer-replay.md``).

A request's records are buffered in memory and written as one chunk when it finishes, or every
``chunk_tokens`` tokens while it runs. Chunks are encoded and written on one background thread, so the engine
never waits for either (a chunk whose records cannot be encoded, a bug of its writer, is logged and reported by
:meth:`flush`). A write that fails is kept and tried again (after ``retry_s``, on the next successful write and in
:meth:`flush`); nothing is dropped. With a ``spill_dir`` a chunk the store refused is also written at once to
``<spill_dir>/<key>`` (create-if-absent, whole file or nothing) and removed once the store has it, so a process
killed before the store comes back loses nothing: a recorder started on the same spill directory queues every
chunk it finds there (any writer's; each keeps its key). :meth:`flush` waits for every buffered and queued chunk
and raises :class:`ReplayUploadError` if any still cannot be written (they stay queued, and spilled).

Thread-safety: every method may be called from any thread.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from syncd import manifest as mf
from syncd.engine.spill import spill, unspill
from syncd.errors import ObjectExists, SyncdError
from syncd.records.replay import ReplayChunk, TokenRecord, encode_chunk
from syncd.records.replay_kept import MAX_TOLERANCE
from syncd.records.replay_store import SUFFIX, chunk_key, replay_prefix
from syncd.store import Store

log = logging.getLogger(__name__)

__all__ = ["ReplayRecorder", "ReplayUploadError"]


class ReplayUploadError(SyncdError, RuntimeError):
    """Replay chunks could not be written to the store; they are kept and retried on the next flush."""


@dataclass
class _Pending:
    request_id: str
    records: list[TokenRecord] = field(default_factory=list)
    prompt_start: int = 0
    prompt_routing: np.ndarray | None = None


class ReplayRecorder:
    """Records of one run. ``store``: URL, path or :class:`~syncd.store.Store`. ``vocab_size`` and
    ``num_experts`` (0: dense) describe the model; an engine fills them in with :meth:`configure` when they
    are not given. ``chunk_tokens``: a running request is written every that many tokens. ``kept_tolerance``
    (``delta`` > 0, in scaled-logit units, or None), ``spill_dir`` (a local folder, or None) and ``retry_s`` (how
    long a refused chunk waits before the next try): see the module docstring."""

    def __init__(self, store, run_id: str, *, vocab_size: int | None = None, num_experts: int = 0,
                 chunk_tokens: int = 1024, writer: str | None = None, kept_tolerance: float | None = None,
                 spill_dir: str | os.PathLike | None = None, retry_s: float = 5.0):
        if chunk_tokens < 1:
            raise ValueError("chunk_tokens must be at least 1")
        if not (isinstance(retry_s, (int, float)) and retry_s > 0):
            raise ValueError(f"retry_s must be a number > 0, got {retry_s!r}")
        if kept_tolerance is not None and not (isinstance(kept_tolerance, (int, float)) and
                                               0 < kept_tolerance <= MAX_TOLERANCE):
            raise ValueError(f"kept_tolerance must be a number in (0, {MAX_TOLERANCE}] or None, got {kept_tolerance!r}")
        self.kept_tolerance = float(kept_tolerance or 0.0)
        self.store = Store.open(store)
        self.run_id = mf.check_run_id(run_id)
        self.vocab_size, self.num_experts = vocab_size, num_experts
        self.chunk_tokens = chunk_tokens
        self.writer = writer or secrets.token_hex(8)
        if not re.fullmatch(r"[0-9a-f]{16}", self.writer):
            raise ValueError("writer must be 16 lower-case hex digits")
        self.written: list[str] = []  # keys written, in order
        self.spill_dir = None if spill_dir is None else Path(spill_dir)
        self.retry_s = float(retry_s)
        self.spilled: dict[str, Path] = {}  # key -> its spill file, until the store has it
        self._lock = threading.Condition()
        self._pending: dict[str, _Pending] = {}
        self._queue: deque[tuple[str, bytes | ReplayChunk]] = deque()  # chunks are encoded by the writer thread
        self._failed: deque[tuple[str, bytes]] = deque()
        self._inflight = 0
        self._closed = False
        self._last_error: BaseException | None = None
        self.unencodable = 0  # chunks dropped because their records could not be encoded (until flush reports them)
        if self.spill_dir is not None:
            self._queue.extend(self._spilled_earlier())
        self._thread = threading.Thread(target=self._worker, name=f"replay-{run_id}", daemon=True)
        self._thread.start()

    def configure(self, *, vocab_size: int, num_experts: int = 0) -> None:
        """Set the model facts unless they were given to the constructor."""
        if self.vocab_size is None:
            self.vocab_size = vocab_size
            self.num_experts = num_experts

    # ------------------------------------------------------------------------------------ recording

    def add(self, request_id: str, *, position: int, index: int, version: int | None, token_id: int,
            logprob: float, kept, routing=None, kept_margins=None) -> None:
        """One generated token (see :class:`~syncd.records.replay.TokenRecord`). ``kept``: ids (tensor or
        array; in rank order when ``kept_margins``, the sampler's gaps, are given); ``routing``: ``[layers,
        top_k]`` expert ids or None."""
        if self.vocab_size is None:
            raise RuntimeError("ReplayRecorder needs vocab_size (constructor or configure())")
        margins = None if kept_margins is None or not self.kept_tolerance else _np(kept_margins)
        rec = TokenRecord(position, index, version, int(token_id), float(logprob), _np(kept),
                          None if routing is None else _np(routing), margins)
        with self._lock:
            p = self._pending.setdefault(request_id, _Pending(request_id))
            if p.records and (position != p.records[-1].position + 1 or index != p.records[-1].index + 1):
                self._cut(p)  # not consecutive (should not happen): start a new chunk
            p.records.append(rec)
            if len(p.records) >= self.chunk_tokens:
                self._cut(p)

    def add_prompt_routing(self, request_id: str, start_position: int, routing) -> None:
        """Routing of positions ``start_position ...`` processed without sampling (``[layers, m, top_k]``,
        as the engine captures it)."""
        r = _np(routing)
        if r.ndim != 3 or r.shape[1] == 0:
            return
        with self._lock:
            p = self._pending.setdefault(request_id, _Pending(request_id))
            p.prompt_start, p.prompt_routing = start_position, np.ascontiguousarray(r.transpose(1, 0, 2))

    def finish(self, request_id: str) -> None:
        """The request ended: write what is buffered for it."""
        with self._lock:
            p = self._pending.pop(request_id, None)
            if p is not None and p.records:
                self._cut(p)

    def _cut(self, p: _Pending) -> None:
        """Queue ``p``'s records as one chunk (lock held)."""
        chunk = ReplayChunk(p.request_id, self.vocab_size, p.records, self.num_experts, p.prompt_start,
                            p.prompt_routing, self.kept_tolerance)
        key = chunk_key(self.run_id, p.request_id, self.writer, chunk.first_position)
        self._queue.append((key, chunk))
        p.records, p.prompt_routing = [], None
        self._lock.notify_all()

    # ------------------------------------------------------------------------------------ writing

    def _worker(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    if not self._lock.wait(self.retry_s if self._failed else None) and self._failed:
                        self._queue.extend(self._failed)  # retry_s passed: try the refused chunks again
                        self._failed.clear()
                if not self._queue:
                    return
                item = self._queue.popleft()
                self._inflight += 1
            if isinstance(item[1], ReplayChunk):
                try:
                    item = (item[0], encode_chunk(item[1]))
                except Exception as exc:  # noqa: BLE001 -- malformed records: reported by flush, never retried
                    log.error("replay chunk %s cannot be encoded, dropped: %s", item[0], exc)
                    with self._lock:
                        self.unencodable += 1
                        self._last_error = exc
                        self._inflight -= 1
                        self._lock.notify_all()
                    continue
            ok = self._put(*item)
            if ok:
                self._unspill(item[0])
            elif self.spill_dir is not None and item[0] not in self.spilled:
                self._spill(*item)
            with self._lock:
                self._inflight -= 1
                if ok:
                    self.written.append(item[0])
                    if self._failed:  # the store works again: retry what failed before
                        self._queue.extend(self._failed)
                        self._failed.clear()
                else:
                    self._failed.append(item)
                self._lock.notify_all()

    def _put(self, key: str, data: bytes) -> bool:
        try:
            self.store.put(key, data, create=True)
            return True
        except ObjectExists:
            try:
                if self.store.get(key) == data:  # our own earlier attempt landed
                    return True
            except SyncdError:
                pass
            self._last_error = ObjectExists(f"{key} exists with other content")
        except Exception as exc:  # noqa: BLE001 - kept and reported by flush()
            self._last_error = exc
        log.warning("replay chunk %s not written (%s); kept for retry", key, self._last_error)
        return False

    # ------------------------------------------------------------------------------------ spilling

    def _spill(self, key: str, data: bytes) -> None:
        """Write a refused chunk to ``<spill_dir>/<key>`` (create-if-absent via a temporary file and a link);
        logged if the disk refuses too."""
        path = self.spill_dir / key
        try:
            if not spill(path, data):
                log.error("replay chunk %s: %s holds other bytes; not spilled", key, path)
                return
        except OSError as exc:
            log.error("replay chunk %s could not be spilled to %s: %s", key, self.spill_dir, exc)
            return
        self.spilled[key] = path
        log.warning("replay chunk %s kept in %s until the store takes it", key, path)

    def _unspill(self, key: str) -> None:
        unspill(self.spilled.pop(key, None), f"replay chunk {key}", log)

    def _spilled_earlier(self) -> list[tuple[str, bytes]]:
        """The chunks an earlier recorder spilled under this run (queued again, keys unchanged)."""
        root = self.spill_dir / replay_prefix(self.run_id)
        found = []
        for path in sorted(root.rglob(f"*{SUFFIX}")) if root.is_dir() else ():
            key = path.relative_to(self.spill_dir).as_posix()
            try:
                found.append((key, path.read_bytes()))
                self.spilled[key] = path
            except OSError as exc:
                log.error("spilled replay chunk %s cannot be read: %s", path, exc)
        if found:
            log.warning("%d spilled replay chunk(s) found in %s; writing them", len(found), self.spill_dir)
        return found

    # ------------------------------------------------------------------------------------ waiting

    def flush(self, timeout: float | None = 60.0) -> None:
        """Write every buffered request's records (running ones too) and wait until everything queued is
        written. Raises ReplayUploadError if some chunks could not be written (they stay queued for the next
        flush) and TimeoutError if the writes take longer than ``timeout`` seconds."""
        with self._lock:
            for p in list(self._pending.values()):
                if p.records:
                    self._cut(p)
            self._queue.extend(self._failed)
            self._failed.clear()
            self._lock.notify_all()
            if not self._lock.wait_for(lambda: not self._queue and not self._inflight, timeout):
                raise TimeoutError(f"replay chunks still being written after {timeout} s")
            if self._failed:
                raise ReplayUploadError(f"{len(self._failed)} replay chunk(s) could not be written to "
                                        f"{self.store.url}: {self._last_error}")
            if self.unencodable:  # reported once
                dropped, self.unencodable = self.unencodable, 0
                raise ReplayUploadError(f"{dropped} replay chunk(s) could not be encoded and were dropped: "
                                        f"{self._last_error}")

    def close(self, timeout: float | None = 60.0) -> None:
        """:meth:`flush`, then stop the writer thread."""
        try:
            self.flush(timeout)
        finally:
            with self._lock:
                self._closed = True
                self._lock.notify_all()
            self._thread.join(timeout)


def _np(x) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=np.int64) if np.asarray(x).dtype.kind in "iub" else np.asarray(x)
