"""The node's state as a JSON file, for ``syncd status`` and for tools (the demo's progress display).

The daemon rewrites the file atomically (write to a temp file, ``os.replace``) whenever something changes,
at most every ``StatusBoard.min_interval_s`` (a change inside that interval is written at its end). Content::

    {"pid", "run_id", "store", "cache_dir", "metrics_url",
     "state": "starting|running|unknown run|stopping|stopped", "started_at", "updated_at" (unix seconds),
     "newest_version", "store_error" (last poll error or null), "run_error" (why the run has no versions:
     "run 'x' has no versions in URL; runs there: ..."), "cache_error" (e.g. the cache disk is full),
     "round_error" (the last update round's unexpected failure), "tasks": {name: {"state", "restarts",
     "last_error", "last_error_at"}} (supervised tasks),
     "engines": {name: {"url", "version", "lag", "state", "error", "applied", "last_pause_s"}},
     "totals": {counter: number}, "updates": [{"version", "kind", "bytes", "download_s", "stage_s",
     "pause_s": {engine: s}, "noticed_at", "done_at", "created_at"}, ...]  (newest last, at most 200)}

One daemon at a time: :meth:`StatusBoard.claim` (the daemon's first act when it runs) takes an exclusive lock on
its cache directory (``daemon.lock`` in it) and on its status file (``<status file>.lock``), held until
:meth:`StatusBoard.release` or the process ends; a second daemon on either is refused with
:class:`DaemonLockHeld` naming the holder (pid, run, since when), instead of the two rewriting one status file in
turn (``syncd status`` would flip between them) and cleaning each other's cache.

Thread-safe (one lock); writing never raises (a failed write is logged).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import threading
import time
from collections import deque
from pathlib import Path

from syncd import jsonsafe
from syncd.cache import pid_alive  # noqa: F401  (re-exported: `syncd status` uses it)

log = logging.getLogger(__name__)
MAX_UPDATES = 200
MAX_STATUS_BYTES = 16 << 20  # what read_status reads at most (the file holds MAX_UPDATES records)


def default_status_file(cache_dir: Path, run_id: str) -> Path:
    return Path(cache_dir, f"status-{run_id}.json")


class DaemonLockHeld(ValueError):
    """Another daemon holds the cache directory or the status file (the message names it)."""


class StatusBoard:
    """The daemon's state, mirrored to ``path``. ``min_interval_s``: the least time between two unforced writes."""

    min_interval_s = 0.2

    def __init__(self, path: Path, **fields):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._doc = {"pid": os.getpid(), "state": "starting", "started_at": time.time(), "newest_version": None,
                     "store_error": None, "engines": {}, "totals": {}, **fields}
        self._updates: deque = deque(maxlen=MAX_UPDATES)
        self._last_write = 0.0
        self._held: list[int] = []  # file descriptors of the locks claim() took

    def claim(self, cache_dir: Path) -> None:
        """Lock ``cache_dir`` and this status file for this daemon (see the module docstring); raises
        :class:`DaemonLockHeld` naming the daemon that holds one. Idempotent."""
        if self._held:
            return
        what = {Path(cache_dir, "daemon.lock"): f"the cache directory {cache_dir}",
                self.path.with_name(self.path.name + ".lock"): f"the status file {self.path}"}
        holder = json.dumps({"pid": os.getpid(), "run_id": self._doc.get("run_id"), "status_file": str(self.path),
                             "since": time.time()})
        try:
            for path, name in what.items():
                path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    raise DaemonLockHeld(f"{name} is in use by another syncd daemon ({_holder(path)}): one daemon "
                                         "per cache directory and status file; give this one its own --cache-dir "
                                         "(and --status-file), or stop that one") from None
                self._held.append(fd)
                os.ftruncate(fd, 0)
                os.pwrite(fd, holder.encode(), 0)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Give up the locks :meth:`claim` took (a later daemon may take them)."""
        while self._held:
            os.close(self._held.pop())  # closing the descriptor drops its lock

    def set(self, **fields) -> None:
        with self._lock:
            self._doc.update(fields)

    def get(self, name: str):
        with self._lock:
            return self._doc.get(name)

    def engine(self, name: str, **fields) -> None:
        with self._lock:
            self._doc["engines"].setdefault(name, {}).update(fields)

    def add_update(self, record: dict) -> None:
        with self._lock:
            self._updates.append(record)

    def snapshot(self) -> dict:
        with self._lock:
            doc = json.loads(json.dumps(self._doc, default=str))
            doc["updates"] = list(self._updates)
            return doc

    def write(self, totals: dict | None = None, *, force: bool = False) -> bool:
        """Write the file now, or return False without writing when ``force`` is false and the last write is less
        than ``min_interval_s`` ago (the caller writes again later). True once written or failed to write."""
        now = time.time()
        if not force and now - self._last_write < self.min_interval_s:
            return False
        self._last_write = now
        with self._lock:
            if totals is not None:
                self._doc["totals"] = dict(totals)
            self._doc["updated_at"] = now
            data = json.dumps({**self._doc, "updates": list(self._updates)}, default=str, indent=1)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(data)
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("cannot write status file %s: %s", self.path, exc)
        return True


def _holder(lock_file: Path) -> str:
    """Who holds ``lock_file``, as its holder wrote it: ``pid 123, run r, since 2024-...``."""
    try:
        doc = jsonsafe.loads(lock_file.read_bytes(), what=str(lock_file), max_bytes=4096, max_depth=2)
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(doc["since"])))
        return f"pid {doc['pid']}, run {doc['run_id']}, status file {doc['status_file']}, since {since}"
    except (OSError, ValueError, KeyError, TypeError):
        return f"its lock file {lock_file} names none"


def read_status(path: Path) -> dict:
    """The status file's content, parsed bounded and strictly (:func:`syncd.jsonsafe.loads`); ``FileNotFoundError``
    / ``ValueError`` if missing or unreadable."""
    with open(path, "rb") as fh:
        raw = fh.read(MAX_STATUS_BYTES + 1)
    return jsonsafe.loads(raw, what=f"status file {path}", max_bytes=MAX_STATUS_BYTES, max_depth=16)

