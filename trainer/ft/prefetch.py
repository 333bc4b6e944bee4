"""Reading an owner's newest checkpoint ahead of its restore: what lets a warm standby (:mod:`syncd.trainer.standby`)
restore without reading a checkpoint at its takeover.

    pre = CheckpointPrefetch(own_dir, owner="rank-0", run_id=run_id).start()
    ...                                  # the run's trainer checkpoints every step into own_dir
    ft.preloaded = pre.stop()            # the newest ones read, verified and parsed (newest first)
    restore_together(ft, dp)             # FaultTolerance.load uses it if it is still the one on disk

One background thread polls ``own_dir`` and reads each newer checkpoint completely, verified exactly as a restore
reads it (:func:`~syncd.trainer.ft.ckpt_format.read_dir`: manifest, signature, owner, step, run, every file's
SHA-256), at the lowest CPU priority (Linux's nice is per thread), so that on a shared machine it takes nothing
from the trainer that writes the checkpoints. It keeps the newest ``depth`` checkpoints (default 2: the step a job's
ranks agree on can be one behind a rank's newest, because the ranks' checkpoints of the last step land at different
times), and drops the oldest before it reads a newer one: ``depth`` checkpoints' memory at most. A folder that fails
to verify is logged and counted, and read again only once its manifest changes (or a newer one lands); the thread
survives any failure and ends only when stopped.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from syncd.trainer.ft.ckpt_dir import Checkpoint, list_steps, parse_checkpoint, step_dir
from syncd.trainer.ft.ckpt_format import MANIFEST, StateError, manifest_digest, read_dir

log = logging.getLogger(__name__)

__all__ = ["CheckpointPrefetch", "Prefetched"]


@dataclass
class Prefetched:
    """A checkpoint read ahead: its ``step``, the SHA-256 of the manifest it was verified against, the parsed
    :class:`~syncd.trainer.ft.ckpt_dir.Checkpoint`."""

    step: int
    digest: str
    checkpoint: Checkpoint

    def current(self, own, step: int | None) -> bool:
        """Whether this is still the checkpoint of ``step`` in folder ``own`` (None: the newest there), by its
        manifest's digest: a restore that went back and wrote the step again has another manifest."""
        if step is None:
            steps = list_steps(own)
            step = steps[0] if steps else None
        if step != self.step:
            return False
        try:
            return manifest_digest((step_dir(own, step) / MANIFEST).read_bytes()) == self.digest
        except OSError:
            return False


class CheckpointPrefetch:
    """See the module docstring. ``own``: the owner's checkpoint folder; ``owner``, ``run_id``, ``signing_key``:
    what a restore checks each manifest against; ``poll_s``: seconds between looks. Thread-safe: :meth:`stop` may be
    called from any thread."""

    def __init__(self, own, *, owner: str, run_id: str | None, signing_key=None, poll_s: float = 1.0,
                 depth: int = 2):
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.own, self.owner, self.run_id, self.signing_key = Path(own), owner, run_id, signing_key
        self.poll_s, self.depth = poll_s, depth
        self.reads = self.failures = 0
        self._have: list[Prefetched] = []  # newest first
        self._refused: tuple[int, str] | None = None  # (step, manifest digest) of the last folder that failed
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"prefetch-{owner}", daemon=True)

    def start(self) -> "CheckpointPrefetch":
        self._thread.start()
        return self

    def stop(self) -> list[Prefetched]:
        """Stop polling; the checkpoints read completely, newest first (empty: none yet). A read in flight is not
        waited for: its result is dropped (the thread ends when it returns)."""
        self._stop.set()
        with self._lock:
            have, self._have = self._have, []
        return have

    def _run(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only (Linux)
        except (OSError, AttributeError):
            pass
        while not self._stop.wait(self.poll_s):
            try:
                self._look()
            except Exception:  # noqa: BLE001 -- the prefetch outlives any one failed read
                self.failures += 1
                log.exception("%s: prefetching a checkpoint failed", self.owner)

    def _look(self) -> None:
        steps = list_steps(self.own)
        with self._lock:
            if not steps or (self._have and self._have[0].step >= steps[0]):
                return
        step = steps[0]
        path = step_dir(self.own, step)
        try:
            manifest = manifest_digest((path / MANIFEST).read_bytes())
        except OSError:  # removed by retention since the listing
            return
        if self._refused == (step, manifest):  # the same bad folder is not read again every poll
            return
        with self._lock:
            self._have = self._have[:self.depth - 1]  # room for the one read next
        try:
            bundle = read_dir(path, signing_key=self.signing_key, owner=self.owner, step=step, run_id=self.run_id)
            got = Prefetched(step, manifest_digest(bundle.raw_manifest), parse_checkpoint(bundle, str(path)))
        except StateError as exc:  # removed meanwhile, or corrupt: a restore would refuse it too
            self.failures += 1
            self._refused = (step, manifest)
            log.warning("%s: checkpoint %d not read ahead: %s", self.owner, step, exc)
            return
        self.reads += 1
        with self._lock:
            if not self._stop.is_set():
                self._have = [got, *self._have][:self.depth]
