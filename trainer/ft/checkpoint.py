"""Per-step asynchronous checkpoints: model, optimizer, RNG and loop state, to local disk in the background.

    ckpt = Checkpointer("/local/ckpt/rank-0", owner="rank-0", keep=2)
    for step in ...:
        loss.backward(); ...
        ckpt.before_update()           # waits only if the previous snapshot is still being copied
        opt.step(); opt.zero_grad()
        ckpt.save(step, model, opt, state={"cursor": ...})   # returns at once
    ckpt.close()

:meth:`Checkpointer.save` takes the references of the step's tensors and the loop state (JSON-able, copied at
once) and hands them to a background thread, which first **snapshots** the tensors into host buffers (reused
from one checkpoint to the next) while the next step's forward and backward run -- they do not change weights
or optimizer state -- and then **writes** them. :meth:`before_update` is the only wait: the next optimizer step
must not start before the snapshot holds the old values. If the previous checkpoint is still being written when
the next is due, ``on_busy="wait"`` (default) waits for it -- every step is checkpointed, and a crash costs at most
the step in flight; the wait is a stall only while a write takes longer than a step -- and ``"skip"`` skips this
step's checkpoint (counted): no stall, but a crash may then cost more than one step. Ranks that must hold the same
steps (a data-parallel job restores the newest step *every* rank has) decide together: :attr:`Checkpointer.busy`
on every rank, then ``save(..., skip=<any rank busy>)``.

A checkpoint is the folder ``step-<12 digits>`` of a bundle, written atomically and read back verified by
:mod:`syncd.trainer.ft.ckpt_dir` (whose names this module re-exports). ``keep`` bounds retention: the newest ``keep``
complete checkpoints stay, and so does :attr:`Checkpointer.common_step`, the newest step the ranks agreed every
one of them holds (:meth:`Checkpointer.agree`, :func:`agreement`), so a rank whose writes keep failing cannot
leave the others without a step it also has.

Listeners (``on_durable(step, path)``, e.g. the replicator) run on the writer thread after the rename; an
exception there is logged, never raised into training.

**A failed write is retried** (a full disk, a quota, an I/O error): the snapshot stays in its buffers and the
write is tried again as soon as the file system has room for it (polled every :data:`ROOM_POLL_S`; other errors
back off up to :data:`MAX_BACKOFF_S`), until it lands or a newer step's checkpoint replaces it (the newer one is
written instead: it holds everything the older one did). Every failed attempt is logged and counted
(:attr:`CheckpointStats.failures`), and so are ``retried`` (writes that landed on a retry) and ``abandoned``
(replaced before they landed); training goes on meanwhile -- a write waiting for room is never waited for by
:meth:`Checkpointer.wait_previous`, and ``save`` replaces it rather than waiting -- and whoever waits for the step
to be durable (the publisher's gate) is released the moment the retry lands. Thread-safety: call
``save``/``before_update``/``close`` from the training thread.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from syncd.trainer.ft.ckpt_dir import (TMP_PREFIX, Checkpoint, capture_rng, list_steps, model_tensors,
                                       newest_checkpoint, parse_checkpoint, restore_rng, step_dir, write_bundle_dir)
from syncd.trainer.ft.ckpt_format import check_owner
from syncd.trainer.ft.state_tree import flatten

log = logging.getLogger(__name__)

__all__ = ["Checkpointer", "CheckpointStats", "agreement", "agreed_step", "Checkpoint", "newest_checkpoint",
           "parse_checkpoint", "list_steps", "step_dir", "capture_rng", "restore_rng", "write_bundle_dir",
           "model_tensors", "ROOM_POLL_S", "MAX_BACKOFF_S"]

#: how often a write that failed for lack of room checks whether the file system has room again (seconds)
ROOM_POLL_S = 0.05
#: the longest wait between two tries of a write that failed otherwise (seconds; doubling from ROOM_POLL_S)
MAX_BACKOFF_S = 2.0
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT)

@dataclass
class CheckpointStats:
    """What checkpointing cost, in seconds: ``stall_s`` the training thread waited (total; ``last_stall_s``),
    ``snapshot_s``/``write_s`` the background copy and write of the last checkpoint; ``saved``, ``skipped``
    (due while the previous one was still being written), ``failures`` (failed write attempts), ``retried``
    (checkpoints written on a retry), ``abandoned`` (failed ones a newer checkpoint replaced), ``last_error``;
    ``bytes`` of the last one."""

    saved: int = 0
    skipped: int = 0
    failures: int = 0
    retried: int = 0
    abandoned: int = 0
    last_error: str | None = None
    stall_s: float = 0.0
    last_stall_s: float = 0.0
    snapshot_s: float = 0.0
    write_s: float = 0.0
    bytes: int = 0
    stalls: list = field(default_factory=list)


class Checkpointer:
    """Asynchronous per-step checkpoints of one owner into ``root`` (see the module docstring)."""

    def __init__(self, root, *, owner: str, keep: int = 2, on_busy: str = "wait", fsync: bool = True,
                 signing_key=None, on_durable=(), run_id: str | None = None):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        if on_busy not in ("skip", "wait"):
            raise ValueError("on_busy must be 'skip' or 'wait'")
        self.root, self.owner = Path(root), check_owner(owner)
        self.keep, self.on_busy, self.fsync, self.signing_key = keep, on_busy, fsync, signing_key
        self.run_id = run_id  # written into every manifest (None: no run named)
        self.on_durable = list(on_durable)
        self.stats = CheckpointStats()
        self.durable_step: int | None = max(list_steps(self.root), default=None)
        self.last_attempt: tuple[int, bool] | None = None  # (step, written) of the newest write that ended
        self.common_step: int | None = None  # the newest step every rank holds, as agreed (None: not known)
        self._buffers: dict[str, torch.Tensor] = {}
        self._job = None  # the next checkpoint to snapshot and write, handed over by save()
        self._current: int | None = None  # the step being snapshotted or written
        self._retrying = False  # the current write failed and waits for room (a newer save replaces it)
        self._copied = threading.Event()
        self._copied.set()
        self._idle = threading.Event()
        self._idle.set()
        self._cond = threading.Condition()
        self._closed = False
        self.root.mkdir(parents=True, exist_ok=True)
        for name in os.listdir(self.root):
            if name.startswith(TMP_PREFIX):
                shutil.rmtree(self.root / name, ignore_errors=True)  # a crash's leftovers: never complete
        self._thread = threading.Thread(target=self._work, name=f"ckpt-{owner}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------------ training thread

    @property
    def busy(self) -> bool:
        """True while a checkpoint is still being snapshotted or written."""
        return not self._idle.is_set()

    def save(self, step: int, model, optimizer=None, *, state=None, rng: bool = True, wait: bool = False,
             skip: bool | None = None) -> bool:
        """Checkpoint ``step`` in the background; False if skipped. ``wait=True``: never skipped (a step that
        must be checkpointed: one a publish waits on, the last). ``skip``: the decision taken by the caller for
        every rank alike (True: skip, False: wait for a write in flight); None: this checkpointer's ``on_busy``,
        applied if the previous one is still being written."""
        t0 = time.perf_counter()
        if skip is None:
            skip = self.on_busy == "skip" and self.busy
        if skip and not wait:
            self.stats.skipped += 1
            log.info("%s: step %d not checkpointed: step %s still being written", self.owner, step, self._current)
            return False
        with self._cond:  # a write in flight is waited for; one waiting for room is replaced by this one
            while not self._idle.is_set() and not self._retrying:
                self._cond.wait()
        tensors = {f"model/{k}": v for k, v in model_tensors(model).items()}
        opt_t, opt_sk = flatten(optimizer.state_dict() if optimizer is not None else None, "optim")
        rng_t, rng_sk = flatten(capture_rng() if rng else None, "rng")
        st_t, st_sk = flatten(state, "state")
        side = {**opt_t, **rng_t, **st_t}
        doc = json.dumps({"optim": opt_sk, "rng": rng_sk, "state": st_sk}, allow_nan=False).encode()
        with self._cond:
            self._idle.clear()
            self._copied.clear()
            self._job = (step, tensors, side, doc)
            self._cond.notify_all()
        self._stall(time.perf_counter() - t0)
        return True

    @property
    def retrying(self) -> bool:
        """True while a failed write waits for room to be tried again."""
        return self._retrying

    def wait_previous(self) -> None:
        """Wait (counted as stall) until the checkpoint in flight is written and its listeners ran: with
        ``on_busy="wait"``, a loop that calls this before it reports a step finished never reports a step more
        than one ahead of what a restart can restore. The wait ``save`` would do anyway, done earlier; a write that
        failed and waits for room is not waited for (module docstring)."""
        if self.busy:
            t0 = time.perf_counter()
            with self._cond:
                while not self._idle.is_set() and not self._retrying:
                    self._cond.wait()
            self._stall(time.perf_counter() - t0)

    def agree(self, step: int) -> None:
        """Every rank holds checkpoint ``step`` (the ranks agreed, :func:`agreement`): retention keeps it until a
        newer one is agreed."""
        with self._cond:
            self.common_step = step if self.common_step is None else max(step, self.common_step)

    def before_update(self) -> None:
        """Wait until the snapshot in flight holds its tensors (call before the optimizer changes them)."""
        t0 = time.perf_counter()
        self._copied.wait()
        self._stall(time.perf_counter() - t0)

    def _stall(self, s: float) -> None:
        self.stats.stall_s += s
        self.stats.last_stall_s = s
        self.stats.stalls.append(s)
        if len(self.stats.stalls) > 4096:
            del self.stats.stalls[:2048]

    def mark_durable(self, step: int) -> None:
        """A checkpoint of ``step`` written by someone else (a restore) is on disk: it counts as durable."""
        with self._cond:
            if self.durable_step is None or self.durable_step < step:
                self.durable_step = step
            self._cond.notify_all()

    def rescan(self) -> None:
        """The newest step on disk is the durable one again (after checkpoints were removed from ``root``)."""
        with self._cond:
            self.durable_step = max(list_steps(self.root), default=None)
            self._cond.notify_all()

    def wait_durable(self, step: int, timeout: float | None = None) -> bool:
        """True once a checkpoint of ``step`` or later is on disk (False after ``timeout`` seconds)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self.durable_step is None or self.durable_step < step:
                left = None if deadline is None else deadline - time.monotonic()
                if (left is not None and left <= 0) or (self._closed and self._idle.is_set()):
                    return False
                self._cond.wait(0.5 if left is None else min(left, 0.5))
            return True

    def flush(self, timeout: float | None = None, *, room_timeout: float | None = None) -> bool:
        """Wait until nothing is being written; a write that failed and waits for room is waited for at most
        ``room_timeout`` seconds of waiting (None: like any write). False after either limit."""
        deadline = None if timeout is None else time.monotonic() + timeout
        room_since = None
        with self._cond:
            while not self._idle.is_set():
                now = time.monotonic()
                room_since = (room_since or now) if self._retrying else None
                if room_since is not None and room_timeout is not None and now - room_since >= room_timeout:
                    return False
                if deadline is not None and now >= deadline:
                    return False
                self._cond.wait(0.1)
        return True

    def close(self, timeout: float | None = 600) -> None:
        """Wait up to ``timeout`` for the write in flight, then stop the writer; a write waiting for room is
        abandoned at once (logged, counted)."""
        self.flush(timeout, room_timeout=0)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)

    # ------------------------------------------------------------------------------------ background

    def _work(self) -> None:
        while True:
            with self._cond:
                while self._job is None and not self._closed:
                    self._cond.wait()
                if self._job is None:
                    return
                (step, tensors, side, doc), self._job = self._job, None
                self._current = step
            try:
                t0 = time.perf_counter()
                snap = self._snapshot(tensors, side)
                self._copied.set()
                t1 = time.perf_counter()
                path = self._write_until_done(step, snap, doc)
                if path is not None:
                    self.stats.snapshot_s, self.stats.write_s = t1 - t0, time.perf_counter() - t1
                    self._landed(step, path)
            except Exception as exc:  # noqa: BLE001 -- counted and logged; training goes on
                self._failed(step, exc)
                log.exception("%s: checkpoint of step %d failed", self.owner, step)
            finally:
                with self._cond:
                    self._current, self._retrying = None, False
                    if self._job is None:  # else the next one's snapshot is not taken yet: before_update waits
                        self._copied.set()
                        self._idle.set()
                    self._cond.notify_all()

    def _write_until_done(self, step: int, snap: dict, doc: bytes) -> Path | None:
        """Write ``step``; on an OSError try again once the file system has room (or after a back-off), until it
        lands (its folder), a newer checkpoint is due or the checkpointer closes (None: abandoned)."""
        tries, backoff = 0, ROOM_POLL_S
        need = sum(t.numel() * t.element_size() for t in snap.values()) + len(doc) + (1 << 20)
        while True:
            try:
                path = self._write(step, snap, doc)
            except OSError as exc:
                tries += 1
                self._failed(step, exc)
                no_room = exc.errno in _NO_ROOM
                log.warning("%s: checkpoint of step %d not written (try %d): %s; %s", self.owner, step, tries, exc,
                            "retrying as soon as the disk has room" if no_room else "retrying")
                with self._cond:
                    self._retrying = True
                    self._cond.notify_all()  # a save() waiting for this write may now replace it
                if not self._wait_to_retry(need if no_room else None, backoff):
                    self.stats.abandoned += 1
                    log.warning("%s: checkpoint of step %d abandoned after %d failed tries (%s)", self.owner, step,
                                tries, "a newer one replaces it" if self._job is not None else "closing")
                    return None
                backoff = ROOM_POLL_S if no_room else min(MAX_BACKOFF_S, backoff * 2)
                with self._cond:
                    self._retrying = False
                continue
            if tries:
                self.stats.retried += 1
                log.warning("%s: checkpoint of step %d written on try %d", self.owner, step, tries + 1)
            return path

    def _wait_to_retry(self, need: int | None, backoff: float) -> bool:
        """Wait until the file system under ``root`` has ``need`` bytes free (None: ``backoff`` seconds); False
        when a newer checkpoint is due or the checkpointer closes first."""
        deadline = time.monotonic() + backoff
        while True:
            with self._cond:
                if self._job is not None or self._closed:
                    return False
                self._cond.wait(ROOM_POLL_S)
                if self._job is not None or self._closed:
                    return False
            if need is None:
                if time.monotonic() >= deadline:
                    return True
                continue
            try:
                st = os.statvfs(self.root)
            except OSError:
                return True  # cannot tell: just try
            if st.f_bavail * st.f_frsize >= need:
                return True

    def _landed(self, step: int, path: Path) -> None:
        self.stats.saved += 1
        with self._cond:
            self.durable_step = step if self.durable_step is None else max(step, self.durable_step)
            self.last_attempt = (step, True)
            self._cond.notify_all()
        self._retain()
        for fn in self.on_durable:
            try:
                fn(step, path)
            except Exception:  # noqa: BLE001 -- a listener never stops checkpointing
                log.exception("%s: a listener of checkpoint %d failed", self.owner, step)

    def _failed(self, step: int, exc: BaseException) -> None:
        with self._cond:
            if self.last_attempt is None or self.last_attempt[0] != step:
                self.last_attempt = (step, False)
        self.stats.failures += 1
        self.stats.last_error = f"step {step}: {type(exc).__name__}: {exc}"

    def _snapshot(self, tensors: dict, side: dict) -> dict:
        """Copy into the reused host buffers (new ones where a tensor's layout changed)."""
        out = {}
        with torch.no_grad():
            for name, t in {**tensors, **side}.items():
                buf = self._buffers.get(name)
                if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                    buf = self._buffers[name] = torch.empty(t.shape, dtype=t.dtype, device="cpu",
                                                            pin_memory=t.is_cuda)
                buf.copy_(t, non_blocking=t.is_cuda)
                out[name] = buf
        if any(t.is_cuda for t in tensors.values()):
            torch.cuda.synchronize()
        for name in set(self._buffers) - set(out):
            del self._buffers[name]
        return out

    def _write(self, step: int, snap: dict, doc: bytes) -> Path:
        model = {k[len("model/"):]: v for k, v in snap.items() if k.startswith("model/")}
        side = {k: v for k, v in snap.items() if not k.startswith("model/")}
        path = write_bundle_dir(self.root, step, self.owner,
                                {"model.safetensors": model, "optim.safetensors": side, "state.json": doc},
                                signing_key=self.signing_key, fsync=self.fsync, run_id=self.run_id)
        self.stats.bytes = sum(f.stat().st_size for f in path.iterdir())
        return path

    def _retain(self) -> None:
        steps = list_steps(self.root)
        kept = set(steps[:self.keep]) | {self.common_step}
        for s in steps:
            if s not in kept:
                shutil.rmtree(step_dir(self.root, s), ignore_errors=True)


def agreement(ckpt: Checkpointer | None) -> list[float]:
    """This rank's part of the ranks' agreement on a step all of them hold: three numbers to sum over the ranks
    with the step's other all-reduce, then hand to :func:`agreed_step`. ``ckpt``: None where this rank does not
    checkpoint (its part then never agrees)."""
    last = None if ckpt is None else ckpt.last_attempt
    s, ok = (float(last[0]), 1.0) if last is not None and last[1] else (-1.0, 0.0)
    return [ok, s, s * s]


def agreed_step(sums: list[float], world: int) -> int | None:
    """The step every rank holds, from the sums over ``world`` ranks of :func:`agreement`; None unless every
    rank's newest finished write succeeded and is the same step (equal steps: the sum of their squares is
    ``world`` times the square of their mean, and nothing else is)."""
    ok, s, s2 = sums
    if ok != world or s < 0:
        return None
    step = s / world
    return int(step) if step == int(step) and s2 == world * step * step else None
