"""``WeightPublisher``: publish a trainer's weights as versions in object storage, in the background.

Use it from any training loop::

    pub = WeightPublisher("s3://bucket/rl", "run-42", every_k=1, full_every=16)
    for step in range(n):
        train_step()
        pub.publish(model, step)      # copies the weights (bf16) and returns; encode + upload run behind
    pub.close()                       # waits for the last upload; raises if it failed

Contract:

* ``publish`` takes a snapshot (cast to the serving dtype) and returns; the only time it costs the
  training loop is that copy, plus a wait if the previous version is still uploading (``on_busy="wait"``,
  the default, publishes every due step) -- or, with ``on_busy="skip"``, nothing: that step is skipped.
* Memory is bounded: the snapshot being published plus the previous version (its delta base); the two
  buffer sets are reused, not reallocated. Encoding adds at most ``upload_threads + 1`` shards in flight.
* Every ``every_k`` steps a version is published: a full version (safetensors) first and then every
  ``full_every`` versions, deltas (``syncd.ops.delta``) against the previous version in between. A
  version is visible only when its manifest, written last with create-if-absent, is in the store.
* Weights on a GPU are snapshotted on the GPU (an async copy on the current stream, so the optimizer's
  next kernels are ordered after it) and deltas are encoded there, so only compact blobs cross PCIe.
* A failure in the background is raised, as :class:`~syncd.errors.PublishError`, by the next call to
  ``publish``/``flush``/``close``; the publisher then carries on from the last committed version. A
  :class:`~syncd.errors.VersionConflict` (another publisher wrote a *valid* manifest at the same number) is final.
  A snapshot holding NaN or +-inf is such a failure, and nothing of it is published (:mod:`syncd.publish.finite`).
* Numbering: a publisher's first version follows the run's newest *valid* version (read, parsed and, with a key,
  verified: :func:`syncd.versions.latest_version`), never a high-water mark of manifest names, so a garbage
  manifest far ahead (``versions/999999999998/``) changes nothing; a number already taken by an unusable
  manifest (squatted, torn, of another key) is skipped, at most :data:`MAX_SQUAT_SKIPS` in a row. A restarted
  trainer's publisher starts with a full version.
* ``commit_gate(step)``, when given, runs on the background thread just before a version's manifest is
  written -- the moment it becomes visible -- and may wait (the thin trainer waits until the step's checkpoint
  is durable on ``k + 1`` nodes, so engines never hold weights the trainer could not be restored to) or raise
  (the version fails like an upload).
* Methods are meant for one trainer thread; the background work runs on one internal thread.
"""

from __future__ import annotations

import atexit
import json
import logging
import queue
import secrets
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import torch

from syncd import manifest as mf
from syncd.errors import ObjectExists, ObjectNotFound, PublishError, StoreError, VersionConflict
from syncd.publish.finite import check_finite
from syncd.publish.shard_writer import ShardWriter, delta_formats
from syncd.publish.version_numbers import Squatted, free_number, newest_valid, usable
from syncd.retention import RetentionPolicy, apply_retention
from syncd.signing import resolve_key, signer_of
from syncd.store import Store

log = logging.getLogger(__name__)

_CASTABLE = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_ENCODE_BATCH_ELEMS = 1 << 25  # tensors encoded together: all cores busy, shards still cut progressively
#: version numbers skipped in a row because an unusable manifest squats on them, before publishing gives up
MAX_SQUAT_SKIPS = 64


@dataclass
class VersionStats:
    """What one published version cost. Times in seconds, sizes in bytes.

    ``stall_s``: time ``publish`` spent waiting for the previous upload; ``snapshot_s``: the copy;
    ``encode_s``: building shards (serialising or delta-encoding, hashing); ``upload_s``: waiting for shard
    uploads after encoding and writing the manifest; ``full_bytes``: the same weights as full safetensors."""

    version: int
    step: int
    kind: str
    shard_bytes: int = 0
    manifest_bytes: int = 0
    full_bytes: int = 0
    stall_s: float = 0.0
    snapshot_s: float = 0.0
    encode_s: float = 0.0
    upload_s: float = 0.0

    @property
    def uploaded_bytes(self) -> int:
        return self.shard_bytes + self.manifest_bytes


@dataclass
class _Job:
    step: int
    snap: dict
    events: list
    stats: VersionStats = field(default=None)


class WeightPublisher:
    """Publishes versions of one run. See the module docstring for the contract.

    ``store``: URL, path or :class:`~syncd.store.Store`. ``every_k``: publish when ``step`` is at least
    ``every_k`` past the last published step. ``full_every``: a full version every that many versions
    (1: always full). ``shard_bytes``: target shard size (encoded bytes; a bigger tensor gets a shard of
    its own). ``signing_key``: None reads ``SYNCD_SIGNING_KEY`` / ``SYNCD_SIGNING_KEY_FILE`` (the private key
    of ``syncd keygen``; a key that cannot sign is a ``ValueError`` here); False publishes unsigned. ``dtype``: the
    serving dtype that float32/64/16/bf16 tensors are cast to (None: keep). ``snapshot_device``: where
    snapshots live (None: where each weight is; ``"cpu"`` to spare GPU memory). ``retention``: a
    :class:`~syncd.retention.RetentionPolicy` applied after each version (None: keep everything).
    ``on_busy``: ``"wait"`` or ``"skip"`` when a version is due while the previous one still uploads.
    ``backend``: the codec backend (``syncd.ops``). ``upload_threads``: shards uploaded in parallel.
    ``commit_gate``: see the module docstring. ``delta_format``: the codec format of deltas, 1 (the default)
    or 2 (about 0.75x the bytes, and faster past a few percent changed words, but its context blocks decode
    only where the whole old tensor is at hand); ``sliced_tensors``: with format 2, a regular expression
    (``re.fullmatch``) of the trainer tensor names some engine holds only in slices (tensor parallel): those
    stay in format 1. See :func:`delta_formats`.
    """

    def __init__(self, store, run_id: str, *, every_k: int = 1, full_every: int = 16,
                 shard_bytes: int = 64 << 20, signing_key=None, dtype=torch.bfloat16,
                 snapshot_device=None, on_busy: str = "wait", retention: RetentionPolicy | None = None,
                 backend: str = "auto", upload_threads: int = 4, commit_gate=None, delta_format: int = 1,
                 sliced_tensors: str | None = None):
        if every_k < 1 or full_every < 1:
            raise ValueError("every_k and full_every must be at least 1")
        if shard_bytes < 1:
            raise ValueError("shard_bytes must be positive")
        if on_busy not in ("wait", "skip"):
            raise ValueError("on_busy must be 'wait' or 'skip'")
        self.delta_format_of = delta_formats(delta_format, sliced_tensors)
        self.store = Store.open(store)
        self.run_id = mf.check_run_id(run_id)
        self.every_k, self.full_every, self.shard_bytes = every_k, full_every, shard_bytes
        self.key = resolve_key(signing_key)
        if self.key is None:
            log.warning("publishing run %s UNSIGNED: set SYNCD_SIGNING_KEY_FILE (the private key of `syncd keygen`) "
                        "so engines can authenticate it", run_id)
        else:
            signer_of(self.key)
        self.dtype, self.snapshot_device, self.on_busy = dtype, snapshot_device, on_busy
        self.retention, self.backend, self.commit_gate = retention, backend, commit_gate
        self.session = secrets.token_hex(8)
        self.history: deque[VersionStats] = deque(maxlen=1024)

        self._last_step: int | None = None
        self._next_version: int | None = None  # known after the first job (a store listing)
        self._prev: dict | None = None  # committed version's snapshot: the delta base
        self._prev_manifest: mf.Manifest | None = None
        self._since_full = 0
        self._spare: dict | None = None  # buffers to reuse for the next snapshot
        self._error: BaseException | None = None
        self._fatal = False
        self._closed = False
        self._idle = threading.Event()
        self._idle.set()
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._pool = ThreadPoolExecutor(upload_threads, thread_name_prefix="syncd-upload")
        self._upload_threads = upload_threads
        self._thread = threading.Thread(target=self._worker, name=f"syncd-publisher-{run_id}", daemon=True)
        self._thread.start()
        atexit.register(self._atexit)

    # ------------------------------------------------------------------------------------- trainer side

    def publish(self, weights, step: int) -> bool:
        """Snapshot ``weights`` (a ``state_dict``-like mapping of name -> tensor, or an ``nn.Module``) for
        ``step`` if a version is due, and return at once; True if a snapshot was taken.

        Raises :class:`PublishError` if a background upload failed since the last call, ``ValueError`` for a
        step that does not increase, ``TypeError`` for weights that are not tensors."""
        self._raise_pending()
        if self._closed:
            raise RuntimeError("publish() on a closed WeightPublisher")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(f"step {step} does not increase (last published step {self._last_step})")
        if self._last_step is not None and step - self._last_step < self.every_k:
            return False
        tensors = _tensors_of(weights)
        t0 = time.perf_counter()
        if not self._idle.is_set():
            if self.on_busy == "skip":
                log.warning("run %s step %d: previous version still uploading; skipping this one",
                            self.run_id, step)
                return False
            self._idle.wait()
        self._raise_pending()  # the previous upload may have failed since the check above
        t1 = time.perf_counter()
        snap, events = self._snapshot(tensors)
        t2 = time.perf_counter()
        self._last_step = step
        self._idle.clear()
        stats = VersionStats(-1, step, "?", stall_s=t1 - t0, snapshot_s=t2 - t1)
        self._queue.put(_Job(step, snap, events, stats))
        return True

    def flush(self, timeout: float | None = None) -> None:
        """Wait until the version in flight (if any) is committed; raise :class:`PublishError` if it failed.
        ``TimeoutError`` if it is still uploading after ``timeout`` seconds."""
        if not self._idle.wait(timeout):
            raise TimeoutError(f"run {self.run_id}: upload still in progress after {timeout}s")
        self._raise_pending()

    def publish_model_files(self, model_dir) -> None:
        """Store the model folder's config and tokenizer files with the run (``syncd.model_folder``), signed like
        the manifests, so that ``syncd materialize`` writes a complete Hugging Face folder without
        ``--config-from``. Synchronous; call it once, before or after the first version. Raises ``ValueError``
        (no ``config.json`` in ``model_dir``) and :class:`~syncd.errors.StoreError`."""
        from syncd.model_folder import collect_model_files, put_model_files

        put_model_files(self.store, self.run_id, collect_model_files(model_dir), signing_key=self.key or False)

    def close(self, timeout: float | None = None) -> None:
        """Flush, then stop the background thread. Idempotent; raises like :meth:`flush`."""
        if self._closed:
            return
        try:
            self.flush(timeout)
        finally:
            self._closed = True
            self._queue.put(None)
            self._thread.join(timeout)
            self._pool.shutdown(wait=not self._thread.is_alive())
            atexit.unregister(self._atexit)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def last_version(self) -> int | None:
        """The newest version this publisher committed, or None."""
        return self._prev_manifest.version if self._prev_manifest else None

    def _atexit(self):
        try:
            self.close(timeout=600)
        except Exception:  # noqa: BLE001 -- interpreter exit: report, never raise
            log.exception("run %s: the last version could not be published at exit", self.run_id)

    def _raise_pending(self) -> None:
        err = self._error
        if err is None:
            return
        if not self._fatal:
            self._error = None
        raise PublishError(f"run {self.run_id}: publishing a version failed: {err}") from err

    def _snapshot(self, tensors: dict) -> tuple[dict, list]:
        """Copy ``tensors`` into reusable buffers (cast to the serving dtype). On CUDA the copies are
        queued on the current stream; the returned events mark their completion."""
        def target(t: torch.Tensor):
            dt = self.dtype if self.dtype is not None and t.dtype in _CASTABLE else t.dtype
            dev = _device(self.snapshot_device) if self.snapshot_device is not None else t.device
            return dt, dev

        buf = self._spare
        layout = {n: (tuple(t.shape), *target(t)) for n, t in tensors.items()}
        if buf is None or {n: (tuple(b.shape), b.dtype, b.device) for n, b in buf.items()} != layout:
            buf = {n: torch.empty(s, dtype=dt, device=dev, pin_memory=_pin(dev, tensors[n]))
                   for n, (s, dt, dev) in layout.items()}
        self._spare = None
        devices = set()
        with torch.no_grad():
            for n, t in tensors.items():
                buf[n].copy_(t.detach(), non_blocking=t.is_cuda)
                if t.is_cuda:
                    devices.add(t.device)
        events = []
        for dev in devices:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(dev))
            events.append(ev)
        return buf, events

    # ------------------------------------------------------------------------------------- background

    def _worker(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                for ev in job.events:
                    ev.synchronize()
                check_finite(job.snap, what=f"the weights of step {job.step}")
                self._publish_version(job)
            except BaseException as exc:  # noqa: BLE001 -- surfaced to the trainer on its next call
                log.error("run %s step %d: publishing failed: %s", self.run_id, job.step, exc)
                self._error = exc
                self._fatal = self._fatal or isinstance(exc, VersionConflict)
                self._spare = job.snap  # discard the snapshot, keep the buffers
            finally:
                self._idle.set()

    def _publish_version(self, job: _Job) -> None:
        for _ in range(MAX_SQUAT_SKIPS):
            try:
                return self._publish_once(job)
            except Squatted as exc:
                log.warning("run %s: version number %d was squatted by an unusable manifest during the upload; "
                            "publishing again under the next number", self.run_id, exc.args[0])
        raise PublishError(f"run {self.run_id}: {MAX_SQUAT_SKIPS} version numbers squatted in a row")

    def _publish_once(self, job: _Job) -> None:
        if self._next_version is None:
            latest = newest_valid(self.store, self.run_id, self.key)
            self._next_version = 0 if latest is None else latest + 1
        self._next_version = free_number(self.store, self.run_id, self._next_version, self.key, MAX_SQUAT_SKIPS)
        version, prev = self._next_version, self._prev
        same_layout = prev is not None and [(n, t.shape, t.dtype) for n, t in prev.items()] == \
            [(n, t.shape, t.dtype) for n, t in job.snap.items()]
        kind = "delta" if same_layout and self._since_full + 1 < self.full_every else "full"
        st = job.stats
        st.version, st.kind = version, kind
        t0 = time.perf_counter()
        writer = ShardWriter(self, version, kind)
        try:
            if kind == "full":
                for name, t in job.snap.items():
                    writer.add_full(name, t)
            else:
                for names in _batches(job.snap, _ENCODE_BATCH_ELEMS):
                    writer.add_deltas(names, [prev[n] for n in names], [job.snap[n] for n in names])
            t1 = time.perf_counter()
            shards, tensors = writer.finish()
            base = self._prev_manifest if kind == "delta" else None
            m = mf.Manifest(self.run_id, version, kind, base.version if base else None,
                            base.digest if base else None, job.step, mf.now_rfc3339(), self.session,
                            tuple(tensors), tuple(shards))
            raw = m.encode(self.key)
        except BaseException:
            writer.discard()
            raise
        if self.commit_gate is not None:
            try:
                self.commit_gate(job.step)
            except BaseException:
                writer.discard()
                raise
        self._put_manifest(version, raw, writer)
        t2 = time.perf_counter()
        self._commit(job, m, raw)
        st.encode_s, st.upload_s = t1 - t0, t2 - t1
        st.shard_bytes, st.manifest_bytes = m.total_bytes, len(raw)
        st.full_bytes = sum(t.nbytes for t in m.tensors)
        self.history.append(st)
        log.info("run %s: published %s version %d (step %d): %d bytes in %d shards, %.3fs encode, %.3fs upload",
                 self.run_id, kind, version, job.step, st.uploaded_bytes, len(m.shards), st.encode_s, st.upload_s)
        self._write_hint(m)
        if self.retention is not None:
            try:
                apply_retention(self.store, self.run_id, self.retention, signing_key=self.key or False)
            except Exception as exc:  # noqa: BLE001 -- retention is housekeeping; publishing goes on
                log.warning("run %s: retention failed: %s", self.run_id, exc)

    def _put_manifest(self, version: int, raw: bytes, writer: "ShardWriter") -> None:
        """Write the manifest, create-if-absent: the moment the version becomes visible. On failure the
        shards are removed -- unless the write's outcome is unknown (the store stopped answering), in
        which case they stay (retention removes them if no manifest names them) and the next version is
        a full one numbered from a fresh listing."""
        key = mf.manifest_key(self.run_id, version)
        try:
            self.store.put(key, raw, create=True)
            return
        except ObjectExists:
            writer.discard()
            if usable(self.store, self.run_id, version, self.key):
                raise VersionConflict(
                    f"run {self.run_id} version {version} was already published by another publisher; "
                    "two trainers are publishing to one run id") from None
            self._next_version = version + 1  # squatted since it was numbered: published again under the next
            raise Squatted(version) from None
        except StoreError as exc:
            failure = exc
        try:
            landed = self.store.get(key, limit=len(raw) + 1) == raw
        except ObjectNotFound:
            landed = False
        except StoreError:
            self._next_version, self._prev, self._prev_manifest = None, None, None
            raise failure from None
        if landed:
            log.warning("run %s version %d: manifest write reported %s, but it is in the store", self.run_id,
                        version, failure)
            return
        writer.discard()
        raise failure

    def _commit(self, job: _Job, m: mf.Manifest, raw: bytes) -> None:
        self._prev_manifest = replace(m, digest=mf.digest(raw))
        self._spare, self._prev = self._prev, job.snap
        self._since_full = 0 if m.kind == "full" else self._since_full + 1
        self._next_version = m.version + 1

    def _write_hint(self, m: mf.Manifest) -> None:
        hint = {"run_id": m.run_id, "version": m.version, "step": m.step, "created_at": m.created_at}
        try:
            self.store.put(mf.latest_hint_key(self.run_id), json.dumps(hint, sort_keys=True).encode())
        except Exception as exc:  # noqa: BLE001 -- only a hint; the manifests are the truth
            log.warning("run %s: could not update the latest-version hint: %s", self.run_id, exc)


def _batches(tensors: dict, elems: int):
    """Names of ``tensors`` in order, in runs of about ``elems`` elements (one big tensor alone)."""
    batch, n = [], 0
    for name, t in tensors.items():
        batch.append(name)
        n += t.numel()
        if n >= elems:
            yield batch
            batch, n = [], 0
    if batch:
        yield batch


def _device(spec) -> torch.device:
    """``spec`` as a device with an explicit index (so that buffer layouts compare equal)."""
    dev = torch.device(spec)
    return torch.device("cuda", torch.cuda.current_device()) if dev.type == "cuda" and dev.index is None else dev


def _pin(dev: torch.device, src: torch.Tensor) -> bool:
    return dev.type == "cpu" and src.is_cuda


def _tensors_of(weights) -> dict:
    if isinstance(weights, torch.nn.Module):
        weights = weights.state_dict()
    if not hasattr(weights, "items"):
        raise TypeError(f"weights must be an nn.Module or a mapping of name -> tensor, not {type(weights).__name__}")
    out = {}
    for name, t in weights.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise TypeError(f"weights must map str -> torch.Tensor; got {type(name).__name__} -> {type(t).__name__}")
        if t.is_sparse or str(t.dtype).removeprefix("torch.") not in mf.DTYPE_SIZES:
            raise TypeError(f"tensor {name!r}: {t.dtype}{' sparse' if t.is_sparse else ''} cannot be published "
                            f"(dense tensors of {', '.join(mf.DTYPE_SIZES)})")
        out[name] = t
    if not out:
        raise ValueError("weights hold no tensors")
    return out
