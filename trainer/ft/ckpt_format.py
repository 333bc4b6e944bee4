"""One format for the trainer's fault-tolerance state: a checkpoint on local disk, a replica a peer holds, the
live state a healing replica group receives. Nothing from a peer or a disk is ever unpickled.

A **bundle** is a few named files and a manifest written last::

    MANIFEST.json       {"format": "syncd.trainer-state", "format_version": 1, "owner": "rank-0", "step": 12,
                         "run_id": "run-42", "created_at": ...,
                         "files": {"model.safetensors": {"bytes": N, "sha256": HEX}, ...},
                         "signature": {"alg", "key_id", "mac"}}   (signature: only with a signing key)
    model.safetensors   the model's state dict under its own names (any safetensors tool reads it)
    optim.safetensors   the optimizer state's tensors, named by their path ("0/state/3/exp_avg")
    state.json          everything else: the skeleton that puts the optimizer state back together (its
                        hyperparameters, step counters, structure), RNG states, the loop's own state

The state's nesting of dicts, lists and tensors is flattened into ``optim.safetensors`` and ``state.json`` by
:mod:`syncd.trainer.ft.state_tree` (:func:`~syncd.trainer.ft.state_tree.flatten`).

The **run id** in the manifest binds a bundle to the run that wrote it: a reader that names its run
(``run_id=``) refuses a bundle of another run, or one that names none, with :class:`RunMismatch` naming both ids
-- a new run never continues an old one's state, and a replica of another run sharing the key is never taken.

On the wire a bundle is **framed**: 8 bytes (little endian) of manifest length, the manifest, then the files in
the manifest's (sorted) order. :func:`read_frame` checks everything against the manifest before a byte is
believed -- bounded sizes, the signature when a key is configured, every file's length and SHA-256 -- and only
then may a caller parse the files (:func:`load_bundle`); with ``manifest_sha256`` the manifest must also be the one
its owner recorded (a replica is trusted only as what its owner wrote). The signature is the run's HMAC key
(``SYNCD_SIGNING_KEY``, :mod:`syncd.signing`): with it a bundle is authenticated by its signature; without it the
hashes prove only that the bytes are the ones the manifest describes, and a replica is authenticated by its
manifest's digest, which its owner recorded (``manifest_sha256``).

Pure functions and immutable values; thread-safe.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from dataclasses import dataclass

import numpy as np
import torch

from syncd import jsonsafe
from syncd.errors import SyncdError
from syncd.manifest import now_rfc3339
from syncd.signing import check_signature, resolve_key, signature_for
from syncd.trainer.ft.safetensors_view import SAFETENSORS_DTYPES, view_safetensors

__all__ = ["StateError", "RunMismatch", "FORMAT", "MANIFEST", "safetensors_header", "write_safetensors",
           "Bundle", "encode_manifest", "parse_manifest", "read_frame", "frame_prefix", "load_bundle",
           "read_dir", "check_owner", "MAX_MANIFEST_BYTES", "manifest_digest"]

FORMAT = "syncd.trainer-state"
FORMAT_VERSION = 1
MANIFEST = "MANIFEST.json"
MAX_MANIFEST_BYTES = 1 << 20
MAX_STATE_JSON_BYTES = 256 << 20
_OWNER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_FILE = re.compile(r"^[a-z][a-z0-9_]{0,31}\.(safetensors|json)$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_CHUNK = 16 << 20

_DTYPES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


class StateError(SyncdError, ValueError):
    """A checkpoint, replica or healing state is torn, corrupt, forged or malformed; the message says which
    file or member and what is wrong. Nothing of it was loaded."""


class RunMismatch(StateError):
    """A bundle of another run (or of no named run) where this run's was expected; the message names both ids."""


def check_owner(owner) -> str:
    """``owner`` if it names a state owner (``rank-0``, ``group-2``: 1-64 of ``[A-Za-z0-9._-]``), else StateError."""
    if not isinstance(owner, str) or not _OWNER.match(owner) or ".." in owner:
        raise StateError(f"invalid state owner {owner!r}: use 1-64 characters of [A-Za-z0-9._-]")
    return owner


# ---------------------------------------------------------------------------------------------- safetensors


def _file_order(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Wider elements first, then by name: every tensor starts aligned to its element size, so a reader can view
    it in place (:mod:`syncd.trainer.ft.safetensors_view`)."""
    return sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))


def safetensors_header(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    """The 8-byte length and JSON header of a safetensors file holding ``tensors`` in :func:`_file_order`, padded
    so that the data starts 8-byte aligned (as the safetensors library writes it)."""
    header, at = {}, 0
    for name in _file_order(tensors):
        t = tensors[name]
        if t.dtype not in _DTYPES:
            raise TypeError(f"tensor {name!r}: dtype {t.dtype} has no safetensors name")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + n]}
        at += n
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(len(raw) + 8) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _bytes_of(t: torch.Tensor) -> memoryview:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def write_safetensors(out, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> dict:
    """Stream ``tensors`` as a safetensors file into the binary file object ``out`` (one pass: written and
    hashed together, no copy of the data). Returns ``{"bytes": n, "sha256": hex}``."""
    h = hashlib.sha256()
    head = safetensors_header(tensors, metadata)
    out.write(head)
    h.update(head)
    n = len(head)
    for name in _file_order(tensors):
        mv = _bytes_of(tensors[name])
        for i in range(0, len(mv), _CHUNK):
            part = mv[i:i + _CHUNK]
            out.write(part)
            h.update(part)
        n += len(mv)
    return {"bytes": n, "sha256": h.hexdigest()}


# ---------------------------------------------------------------------------------------------- manifest


def _message(doc: dict):
    body = {k: v for k, v in doc.items() if k != "signature"}

    def message_for(alg: str, key_id: str) -> bytes:
        return json.dumps({"body": body, "alg": alg, "key_id": key_id}, sort_keys=True,
                          separators=(",", ":")).encode()

    return message_for


def encode_manifest(owner: str, step: int, files: dict[str, dict], *, signing_key=None, extra: dict | None = None,
                    run_id: str | None = None) -> bytes:
    """The manifest of a bundle (``files``: name -> ``{"bytes", "sha256"}``) of run ``run_id`` (None: no run named,
    which a reader that names its run refuses), signed when a key is configured (``signing_key`` as in
    :func:`syncd.signing.resolve_key`)."""
    doc = {"format": FORMAT, "format_version": FORMAT_VERSION, "owner": check_owner(owner), "step": int(step),
           "created_at": now_rfc3339(), "files": {k: dict(files[k]) for k in sorted(files)}, **(extra or {})}
    if run_id is not None:
        doc["run_id"] = str(run_id)
    key = resolve_key(signing_key)
    if key is not None:
        doc["signature"] = signature_for(_message(doc), key)
    return json.dumps(doc, sort_keys=True, allow_nan=False).encode()


def manifest_digest(raw: bytes) -> str:
    """The SHA-256 (hex) of a raw manifest: what an owner records of each checkpoint it replicates."""
    return hashlib.sha256(raw).hexdigest()


def parse_manifest(raw: bytes, *, where: str, signing_key=None, owner: str | None = None,
                   step: int | None = None, run_id: str | None = None) -> dict:
    """The checked manifest in ``raw``: bounded strict JSON, the format, owner, step and run id (each equal to what
    the caller expects, when given), sane file entries, and the signature under the reader's policy. StateError;
    :class:`RunMismatch` for a bundle of another run (or of none) when ``run_id`` is given."""
    doc = jsonsafe.loads(raw, what=where, max_bytes=MAX_MANIFEST_BYTES, max_depth=8, floats=False,
                         unique_members=True, error=StateError)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("format_version") != FORMAT_VERSION:
        raise StateError(f"{where}: not a {FORMAT} v{FORMAT_VERSION} manifest")
    if not isinstance(doc.get("owner"), str) or not _OWNER.match(doc["owner"]):
        raise StateError(f"{where}: owner {str(doc.get('owner'))[:64]!r} is malformed")
    if owner is not None and doc["owner"] != owner:
        raise StateError(f"{where}: the state of {doc['owner']!r}, expected {owner!r}")
    s = doc.get("step")
    if not isinstance(s, int) or isinstance(s, bool) or not 0 <= s < 1 << 62:
        raise StateError(f"{where}: step {s!r} is malformed")
    if step is not None and s != step:
        raise StateError(f"{where}: the state of step {s}, expected step {step}")
    theirs = doc.get("run_id")
    if theirs is not None and (not isinstance(theirs, str) or not 0 < len(theirs) <= 256):
        raise StateError(f"{where}: run_id {str(theirs)[:64]!r} is malformed")
    if run_id is not None and theirs != run_id:
        raise RunMismatch(f"{where}: written by run {theirs!r}, not by this run {run_id!r}" if theirs is not None
                          else f"{where}: names no run id (written before run ids were recorded), not this run "
                               f"{run_id!r}")
    files = doc.get("files")
    if not isinstance(files, dict) or not files or len(files) > 16:
        raise StateError(f"{where}: files must name 1-16 files")
    for name, ent in files.items():
        if not _FILE.match(name) or not isinstance(ent, dict) or set(ent) != {"bytes", "sha256"} \
                or not isinstance(ent["bytes"], int) or isinstance(ent["bytes"], bool) or ent["bytes"] < 0 \
                or not isinstance(ent["sha256"], str) or not _HEX64.match(ent["sha256"]):
            raise StateError(f"{where}: file entry {name[:40]!r} is malformed")
    try:
        check_signature(_message(doc), doc.get("signature"), resolve_key(signing_key), where)
    except SyncdError as exc:
        raise StateError(str(exc)) from None
    return doc


# ---------------------------------------------------------------------------------------------- bundles


@dataclass(frozen=True)
class Bundle:
    """A verified bundle: its manifest (checked) and file contents (hash-checked, not yet parsed; writable
    memoryviews that own their memory as read, or bytes where a caller built the bundle itself). The tensors
    :func:`load_bundle` returns share that memory: do not change it afterwards."""

    manifest: dict
    files: dict[str, memoryview | bytes]
    raw_manifest: bytes = b""

    @property
    def step(self) -> int:
        return self.manifest["step"]

    @property
    def owner(self) -> str:
        return self.manifest["owner"]


def frame_prefix(raw_manifest: bytes) -> bytes:
    """The 8-byte prefix of a frame whose manifest is ``raw_manifest`` (the files follow in sorted order)."""
    return struct.pack("<Q", len(raw_manifest))


def _chunks(read, n: int, what: str):
    """The next ``n`` bytes of ``read(k) -> bytes``, as it gives them; StateError naming ``what`` if they end early."""
    left = n
    while left:
        b = read(min(left, _CHUNK))
        if not b:
            raise StateError(f"{what} ended {left} bytes early (torn)")
        left -= len(b)
        yield b


def _read_exact(read, n: int, what: str) -> bytes:
    parts = list(_chunks(read, n, what))
    return b"".join(parts) if len(parts) != 1 else parts[0]


def read_frame(read, total: int | None, *, where: str, signing_key=None, owner: str | None = None,
               step: int | None = None, run_id: str | None = None, manifest_sha256: str | None = None,
               max_bytes: int = 1 << 40, sink=None, readinto=None) -> Bundle:
    """Read one framed bundle with ``read(n) -> bytes`` (``total``: the frame's length when known, e.g. an HTTP
    Content-Length, which must match the manifest exactly; ``manifest_sha256``: the manifest must be this one,
    checked before it is parsed). With ``sink(name, chunk)`` the files are handed over
    chunk by chunk (and :attr:`Bundle.files` is empty); otherwise each is kept in memory of its own, a
    writable memoryview (filled by ``readinto(memoryview) -> int`` when given: no chunk is allocated or joined,
    and the hash runs on a second thread behind the reads). Every file is hash-checked; StateError for anything wrong."""
    head = _read_exact(read, 8, f"{where}: frame")
    (mlen,) = struct.unpack("<Q", head)
    if mlen > MAX_MANIFEST_BYTES:
        raise StateError(f"{where}: manifest of {mlen} bytes (at most {MAX_MANIFEST_BYTES})")
    raw = _read_exact(read, mlen, f"{where}: manifest")
    if manifest_sha256 is not None and manifest_digest(raw) != manifest_sha256:
        raise StateError(f"{where}: the manifest is not the one its owner recorded (SHA-256 "
                         f"{manifest_digest(raw)[:16]}..., recorded {manifest_sha256[:16]}...)")
    m = parse_manifest(raw, where=where, signing_key=signing_key, owner=owner, step=step, run_id=run_id)
    size = 8 + mlen + sum(e["bytes"] for e in m["files"].values())
    if size > max_bytes:
        raise StateError(f"{where}: {size} bytes, more than the {max_bytes} allowed")
    if total is not None and total != size:
        raise StateError(f"{where}: {total} bytes sent, the manifest describes {size}")
    files = {}
    if sink is None and readinto is not None:
        for name in sorted(m["files"]):
            files[name] = _read_verified(readinto, m["files"][name], f"{where}: {name}")
        return Bundle(m, files, raw)
    for name in sorted(m["files"]):
        ent, h, parts = m["files"][name], hashlib.sha256(), []
        for b in _chunks(read, ent["bytes"], f"{where}: {name}"):
            h.update(b)
            (sink(name, b) if sink is not None else parts.append(b))
        if h.hexdigest() != ent["sha256"]:
            raise StateError(f"{where}: {name} does not match its SHA-256 in the manifest (corrupt)")
        if sink is None:
            files[name] = memoryview(bytearray().join(parts))  # one copy, writable
    return Bundle(m, files, raw)


def _read_verified(readinto, ent: dict, what: str) -> memoryview:
    """One file of ``ent["bytes"]`` read into new memory (not zero-filled first: each page is touched once, by the
    read), its SHA-256 computed on a second thread while the next chunk is read (hashlib and socket or file reads
    release the GIL), checked against ``ent["sha256"]``. A writable memoryview that owns its memory."""
    from concurrent.futures import ThreadPoolExecutor

    try:
        mv = memoryview(np.empty(ent["bytes"], dtype=np.uint8)).cast("B")
    except (MemoryError, ValueError):
        raise StateError(f"{what}: {ent['bytes']} bytes do not fit in memory") from None
    h, at = hashlib.sha256(), 0
    with ThreadPoolExecutor(1, thread_name_prefix="ckpt-hash") as pool:
        pending = None
        while at < len(mv):
            n = readinto(mv[at:at + _CHUNK])
            if not n:
                raise StateError(f"{what} ended {len(mv) - at} bytes early (torn)")
            if pending is not None:
                pending.result()
            pending = pool.submit(h.update, mv[at:at + n])
            at += n
        if pending is not None:
            pending.result()
    if h.hexdigest() != ent["sha256"]:
        raise StateError(f"{what} does not match its SHA-256 in the manifest (corrupt)")
    return mv


def load_bundle(bundle: Bundle, *, where: str) -> tuple[dict[str, dict[str, torch.Tensor]], object]:
    """Parse a verified bundle: ``({file: {name: tensor}} for the safetensors files, state.json's document)``.
    The safetensors files go through :func:`syncd.trainer.ft.safetensors_view.view_safetensors` (checked; the tensors
    view the bundle's memory, a read-only file body is copied once first); state.json through :mod:`syncd.jsonsafe`."""
    tensors = {}
    for name, raw in bundle.files.items():
        if name.endswith(".safetensors"):
            writable = isinstance(raw, (bytearray, memoryview)) and not memoryview(raw).readonly
            tensors[name] = view_safetensors(raw if writable else bytearray(raw),
                                             where=f"{where}: {name}", error=StateError)
    state = None
    if "state.json" in bundle.files:
        state = jsonsafe.loads(bundle.files["state.json"], what=f"{where}: state.json",
                               max_bytes=MAX_STATE_JSON_BYTES, max_depth=64, floats=True, error=StateError)
    return tensors, state


def read_dir(path, *, signing_key=None, owner: str | None = None, step: int | None = None,
             run_id: str | None = None) -> Bundle:
    """The verified bundle in folder ``path`` (manifest first -- its owner, step and run id as expected, when
    given -- then every file against it). StateError (:class:`RunMismatch` for another run's)."""
    where = str(path)
    try:
        raw = open(os.path.join(path, MANIFEST), "rb").read(MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        raise StateError(f"{where}: no {MANIFEST} (torn: the write never finished)") from None
    except OSError as exc:
        raise StateError(f"{where}: {MANIFEST} unreadable: {exc}") from None
    m = parse_manifest(raw, where=where, signing_key=signing_key, owner=owner, step=step, run_id=run_id)
    files = {}
    for name, ent in sorted(m["files"].items()):
        try:
            with open(os.path.join(path, name), "rb") as f:
                held = os.fstat(f.fileno()).st_size
                if held != ent["bytes"]:
                    raise StateError(f"{where}: {name} holds {held} bytes, the manifest says {ent['bytes']} (torn)")
                files[name] = _read_verified(f.readinto, ent, f"{where}: {name}")
        except OSError as exc:
            raise StateError(f"{where}: {name} unreadable: {exc}") from None
    return Bundle(m, files, raw)
