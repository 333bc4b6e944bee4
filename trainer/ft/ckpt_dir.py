"""Checkpoint folders on disk: their layout, the atomic write, the verified read, and what a restore applies.

A checkpoint is the folder ``step-<12 digits>`` of a :mod:`syncd.trainer.ft.ckpt_format` bundle (``model.safetensors``,
``optim.safetensors``, ``state.json``, ``MANIFEST.json`` with every file's SHA-256, signed with the run's key when
one is set, and the run id). :func:`write_bundle_dir` writes it in a hidden temporary folder, every file fsynced, the manifest
last, then renames it into place and fsyncs the parent: a crash leaves either the whole checkpoint or a temporary
folder that is never read (and removed by the next :class:`syncd.trainer.ft.checkpoint.Checkpointer` on that folder).
:func:`write_bundle` writes a bundle already verified in memory the same way, and :func:`land_frame` streams a
framed one (a replica arriving) into place, hashing it on the way. :func:`newest_checkpoint` walks the folder from the newest step down, verifies each candidate completely (the
manifest -- its step the folder's, its run the reader's --, every file's size and hash, the safetensors and JSON
parse) and returns the first that passes; a torn or corrupt one is skipped with a warning that names the file and
the reason, and one of another run is refused (:class:`~syncd.trainer.ft.ckpt_format.RunMismatch`, both ids named):
that is a wrong folder, not damage. Nothing is loaded into a model until the
whole checkpoint verified: no half states. :mod:`syncd.trainer.ft.checkpoint` re-exports these names.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import re
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from syncd.trainer.ft.ckpt_format import (MANIFEST, MAX_MANIFEST_BYTES, Bundle, RunMismatch, StateError,
                                          encode_manifest, load_bundle, parse_manifest, read_dir, read_frame,
                                          write_safetensors)
from syncd.trainer.ft.state_tree import unflatten

log = logging.getLogger(__name__)

__all__ = ["Checkpoint", "newest_checkpoint", "parse_checkpoint", "list_steps", "step_dir", "capture_rng",
           "restore_rng", "write_bundle_dir", "write_bundle", "land_frame", "model_tensors", "runs_in", "TMP_PREFIX"]

_STEP = re.compile(r"^step-(\d{12})$")
#: the name prefix of a folder being written (never a checkpoint; a crash's leftover is removed on the next start)
TMP_PREFIX = ".tmp-"


def step_dir(root, step: int) -> Path:
    return Path(root) / f"step-{step:012d}"


def list_steps(root) -> list[int]:
    """Steps of the checkpoint folders under ``root`` that have a manifest (not yet verified), newest first."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    steps = [int(m.group(1)) for m in map(_STEP.match, names) if m]
    return sorted((s for s in steps if (step_dir(root, s) / MANIFEST).is_file()), reverse=True)


def capture_rng() -> dict:
    """Every RNG the trainer may draw from: Python's, numpy's, torch's CPU and CUDA generators."""
    out = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        out["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover
        pass
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def restore_rng(state: dict) -> None:
    random.setstate(tuple(tuple(x) if isinstance(x, list) else x for x in state["python"]))
    torch.set_rng_state(state["torch"].clone())
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([t.clone() for t in state["cuda"]])


def model_tensors(model) -> dict[str, torch.Tensor]:
    """The model's state dict (references, not copies) or, given a mapping, that mapping."""
    return dict(model.state_dict()) if hasattr(model, "state_dict") else dict(model)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bundle_dir(root, step: int, owner: str, parts: dict[str, object], *, signing_key=None,
                     fsync: bool = True, extra: dict | None = None, run_id: str | None = None) -> Path:
    """Write one checkpoint folder of run ``run_id`` atomically (see the module docstring). ``parts``: file name
    -> a dict of tensors (a ``.safetensors`` file) or bytes (written as is). Returns the final folder; OSError
    (e.g. a full disk) leaves nothing behind."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = step_dir(root, step)
    tmp = root / f"{TMP_PREFIX}{final.name}-{os.getpid()}-{threading.get_ident() % 10**6}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        files = {}
        for name, body in sorted(parts.items()):
            with open(tmp / name, "wb") as f:
                if isinstance(body, dict):
                    files[name] = write_safetensors(f, body, {"format": "pt", "syncd_step": str(step)})
                else:
                    import hashlib

                    f.write(body)
                    files[name] = {"bytes": len(body), "sha256": hashlib.sha256(body).hexdigest()}
                if fsync:
                    f.flush()
                    os.fsync(f.fileno())
        raw = encode_manifest(owner, step, files, signing_key=signing_key, extra=extra, run_id=run_id)
        with open(tmp / MANIFEST, "wb") as f:
            f.write(raw)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        if fsync:
            _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def write_bundle(bundle: Bundle, root) -> Path:
    """Write a verified in-memory bundle to ``root/step-<step>`` atomically (files fsynced, the manifest last,
    renamed into place)."""
    root = Path(root)
    final = step_dir(root, bundle.step)
    tmp = root / f"{TMP_PREFIX}{final.name}-{os.getpid()}-{threading.get_ident()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for name, data in [*sorted(bundle.files.items()), (MANIFEST, bundle.raw_manifest)]:
            with open(tmp / name, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        return final
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def land_frame(read, length, root: Path, *, owner: str, step: int, signing_key, max_bytes: int, where: str,
               run_id: str | None = None, manifest_sha256: str | None = None, lock=None,
               keep: int | None = None) -> Path:
    """Stream one framed bundle into ``root/step-<step>``: a temporary folder while every file is hashed against
    the manifest, renamed into place (under ``lock``, with retention of the newest ``keep`` steps) only when all
    matched (StateError otherwise; nothing is left behind)."""
    final = step_dir(root, step)
    tmp = root / f"{TMP_PREFIX}{final.name}-{os.getpid()}-{threading.get_ident()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    files: dict = {}

    def sink(name, chunk):
        if name not in files:
            files[name] = open(tmp / name, "wb")
        files[name].write(chunk)

    try:
        bundle = read_frame(read, length, where=where, signing_key=signing_key, owner=owner, step=step,
                            run_id=run_id, manifest_sha256=manifest_sha256, max_bytes=max_bytes, sink=sink)
        for name in bundle.manifest["files"]:
            if name not in files:  # an empty file: no chunk was handed over
                files[name] = open(tmp / name, "wb")
        for f in files.values():
            f.flush()
            os.fsync(f.fileno())
            f.close()
        (tmp / MANIFEST).write_bytes(bundle.raw_manifest)
        with lock if lock is not None else contextlib.nullcontext():
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
            for s in (list_steps(root)[keep:] if keep is not None else []):
                shutil.rmtree(step_dir(root, s), ignore_errors=True)
        return final
    finally:
        for f in files.values():
            f.close()
        shutil.rmtree(tmp, ignore_errors=True)


@dataclass
class Checkpoint:
    """A verified checkpoint: ``model`` (name -> tensor), ``optim`` (the optimizer state, as saved), ``rng``,
    ``state`` (the loop's), ``step``, ``path``; ``source``: ``"local"``, or the peer whose replica it was;
    ``bundle``: a replica's verified bundle, until it is written to local disk."""

    step: int
    path: Path
    model: dict
    optim: object
    rng: dict | None
    state: object
    source: str = "local"
    bundle: Bundle | None = None

    def apply(self, model, optimizer=None, *, rng: bool = True) -> None:
        """Load into ``model`` (strict: the same names and shapes) and ``optimizer``; restore the RNGs."""
        missing = set(model.state_dict()) ^ set(self.model)
        if missing:
            raise StateError(f"{self.path}: the checkpoint's tensors and the model's differ: {sorted(missing)[:5]}")
        model.load_state_dict(self.model, strict=True)  # copied into the parameters
        if optimizer is not None and self.optim is not None:
            # the optimizer would keep the tensors it is given (a view of the bundle's memory, which may still be
            # being written to disk) and update them in place: it gets its own
            optimizer.load_state_dict(_owned(self.optim))
        if rng and self.rng is not None:
            restore_rng(self.rng)


def _owned(tree):
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {k: _owned(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_owned(v) for v in tree)
    return tree


def parse_checkpoint(bundle: Bundle, where: str) -> Checkpoint:
    tensors, doc = load_bundle(bundle, where=where)
    if not isinstance(doc, dict) or not {"optim", "rng", "state"} <= set(doc):
        raise StateError(f"{where}: state.json lacks optim/rng/state")
    opt_t = tensors.get("optim.safetensors", {})
    return Checkpoint(bundle.step, Path(where), tensors.get("model.safetensors", {}),
                      unflatten(doc["optim"], opt_t, where=f"{where}: optim"),
                      unflatten(doc["rng"], opt_t, where=f"{where}: rng"),
                      unflatten(doc["state"], opt_t, where=f"{where}: state"))


def newest_checkpoint(root, *, owner: str | None = None, signing_key=None, at_most: int | None = None,
                      step: int | None = None, run_id: str | None = None) -> Checkpoint | None:
    """The newest checkpoint under ``root`` that verifies completely (``at_most``: no later step; ``step``: that
    step only; ``run_id``: of that run), or None. Torn and corrupt ones (a folder whose manifest is of another step
    among them) are skipped with a warning naming the file and the reason; one of another run raises
    :class:`~syncd.trainer.ft.ckpt_format.RunMismatch`."""
    for s in list_steps(root):
        if (at_most is not None and s > at_most) or (step is not None and s != step):
            continue
        path = step_dir(root, s)
        try:
            return parse_checkpoint(read_dir(path, signing_key=signing_key, owner=owner, step=s, run_id=run_id),
                                    str(path))
        except RunMismatch:
            raise
        except StateError as exc:
            log.warning("checkpoint skipped: %s", exc)
    return None


def runs_in(root) -> set:
    """The run ids the checkpoint manifests under ``root`` name (None for one that names none; manifests that do
    not parse are left out): what a new run checks before it writes beside them."""
    runs = set()
    for s in list_steps(root):
        path = step_dir(root, s) / MANIFEST
        try:
            with open(path, "rb") as f:
                runs.add(parse_manifest(f.read(MAX_MANIFEST_BYTES + 1), where=str(path)).get("run_id"))
        except (OSError, StateError):
            continue
    return runs
