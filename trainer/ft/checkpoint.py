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
exception there is logged, never raised into training. A failure to write is logged and counted
(:attr:`CheckpointStats.failures`); training goes on. Thread-safety: call ``save``/``before_update``/``close``
from the training thread.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from syncd.trainer.ft.ckpt_dir import (Checkpoint, capture_rng, list_steps, model_tensors, newest_checkpoint,
                                       parse_checkpoint, restore_rng, step_dir, write_bundle_dir)
from syncd.trainer.ft.ckpt_format import check_owner, flatten

log = logging.getLogger(__name__)

__all__ = ["Checkpointer", "CheckpointStats", "agreement", "agreed_step", "Checkpoint", "newest_checkpoint",
           "parse_checkpoint", "list_steps", "step_dir", "capture_rng", "restore_rng", "write_bundle_dir",
           "model_tensors"]

@dataclass
class CheckpointStats:
    """What checkpointing cost, in seconds: ``stall_s`` the training thread waited (total; ``last_stall_s``),
    ``snapshot_s``/``write_s`` the background copy and write of the last checkpoint; ``saved``, ``skipped``
    (due while the previous one was still being written), ``failures``; ``bytes`` of the last one."""

    saved: int = 0
    skipped: int = 0
    failures: int = 0
    stall_s: float = 0.0
    last_stall_s: float = 0.0
    snapshot_s: float = 0.0
    write_s: float = 0.0
    bytes: int = 0
    stalls: list = field(default_factory=list)


class Checkpointer:
    """Asynchronous per-step checkpoints of one owner into ``root`` (see the module docstring)."""

    def __init__(self, root, *, owner: str, keep: int = 2, on_busy: str = "wait", fsync: bool = True,
                 signing_key=None, on_durable=()):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        if on_busy not in ("skip", "wait"):
            raise ValueError("on_busy must be 'skip' or 'wait'")
        self.root, self.owner = Path(root), check_owner(owner)
        self.keep, self.on_busy, self.fsync, self.signing_key = keep, on_busy, fsync, signing_key
        self.on_durable = list(on_durable)
        self.stats = CheckpointStats()
        self.durable_step: int | None = max(list_steps(self.root), default=None)
        self.last_attempt: tuple[int, bool] | None = None  # (step, written) of the newest write that ended
        self.common_step: int | None = None  # the newest step every rank holds, as agreed (None: not known)
        self._buffers: dict[str, torch.Tensor] = {}
        self._job = None
        self._copied = threading.Event()
        self._copied.set()
        self._idle = threading.Event()
        self._idle.set()
        self._cond = threading.Condition()
        self._closed = False
        self.root.mkdir(parents=True, exist_ok=True)
        for name in os.listdir(self.root):
            if name.startswith(".tmp-"):
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
            log.info("%s: step %d not checkpointed: step %s still being written", self.owner, step,
                     self._job and self._job[0])
            return False
        if self.busy:
            self._idle.wait()
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

    def wait_previous(self) -> None:
        """Wait (counted as stall) until the checkpoint in flight is written and its listeners ran: with
        ``on_busy="wait"``, a loop that calls this before it reports a step finished never reports a step more
        than one ahead of what a restart can restore. The wait ``save`` would do anyway, done earlier."""
        if self.busy:
            t0 = time.perf_counter()
            self._idle.wait()
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

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until nothing is being written; False after ``timeout``."""
        return self._idle.wait(timeout)

    def close(self, timeout: float | None = 600) -> None:
        self.flush(timeout)
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
                step, tensors, side, doc = self._job
            try:
                t0 = time.perf_counter()
                snap = self._snapshot(tensors, side)
                self._copied.set()
                t1 = time.perf_counter()
                path = self._write(step, snap, doc)
                self.stats.snapshot_s, self.stats.write_s = t1 - t0, time.perf_counter() - t1
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
            except Exception:  # noqa: BLE001 -- counted and logged; training goes on
                with self._cond:
                    if self.last_attempt is None or self.last_attempt[0] != step:
                        self.last_attempt = (step, False)
                self.stats.failures += 1
                log.exception("%s: checkpoint of step %d failed", self.owner, step)
            finally:
                self._copied.set()
                with self._cond:
                    self._job = None
                    self._idle.set()
                    self._cond.notify_all()

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
                                signing_key=self.signing_key, fsync=self.fsync)
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
