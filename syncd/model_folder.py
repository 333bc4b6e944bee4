"""A version of a run as a Hugging Face model folder, and the model files (config, tokenizer) a run keeps for it.

The files that describe the model but are not weights (``config.json``, ``generation_config.json``, the tokenizer
files) are stored once per run, next to its versions::

    runs/<run_id>/model/files/<name>         each file, as it was in the trainer's model folder
    runs/<run_id>/model/index.json           {run_id, files: {name: {bytes, sha256}}, signature}; written last

The index is signed with the run's signing key like a manifest (same reader policy: a reader without a key
refuses a signed index unless it reads unchecked) and every file is checked against its digest before use.
Retention never touches ``model/`` (it manages ``versions/`` only).

:func:`write_folder` writes ``model.safetensors`` (or ``model-0000N-of-0000M.safetensors`` shards and
``model.safetensors.index.json``) and the model files into a new folder that ``transformers``'
``from_pretrained``, SGLang's ``update_weights_from_disk`` or an eval job reads; :func:`materialize_folder` does so
for one version of a run (``syncd materialize``). Functions are reentrant; nothing here holds state.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

from syncd import jsonsafe
from syncd import manifest as mf
from syncd.errors import IntegrityError, ManifestError, ObjectNotFound, VersionNotFound
from syncd.signing import check_signature, resolve_key, resolve_policy, signature_for
from syncd.store import Store

log = logging.getLogger(__name__)

__all__ = ["MODEL_FILE_PATTERNS", "collect_model_files", "put_model_files", "get_model_files", "write_folder",
           "materialize_folder"]

#: the non-weight files of a model folder a run keeps (names matched in full)
MODEL_FILE_PATTERNS = (r"config\.json", r"generation_config\.json", r"tokenizer(_config)?\.json",
                       r"special_tokens_map\.json", r"added_tokens\.json", r"vocab\.(json|txt)", r"merges\.txt",
                       r"tokenizer\.model", r"[A-Za-z0-9_.-]*\.tiktoken", r"chat_template\.(jinja|json)",
                       r"preprocessor_config\.json")
_NAME_RE = re.compile("^(?:" + "|".join(MODEL_FILE_PATTERNS) + ")$")
MAX_FILE_BYTES = 64 << 20  # tokenizer.json of large vocabularies is 10-30 MB
MAX_INDEX_BYTES = 64 << 10
_DOMAIN = b"syncd-model-files-v1\0"


def _prefix(run_id: str) -> str:
    return mf.run_prefix(run_id) + "model/"


def collect_model_files(folder) -> dict[str, bytes]:
    """The model files (:data:`MODEL_FILE_PATTERNS`) at the top of ``folder``, by name. Raises ``ValueError`` when
    ``folder`` is not a directory or has no ``config.json``."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"{folder}: not a directory")
    files = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file() and _NAME_RE.match(p.name)}
    if "config.json" not in files:
        raise ValueError(f"{folder}: no config.json (not a Hugging Face model folder)")
    for name, data in files.items():
        if len(data) > MAX_FILE_BYTES:
            raise ValueError(f"{folder / name}: {len(data)} bytes, over the limit of {MAX_FILE_BYTES}")
    return files


def _message(body: dict):
    return lambda alg, key_id: _DOMAIN + mf._canonical({"index": body, "alg": alg, "key_id": key_id})


def put_model_files(store, run_id: str, files: dict[str, bytes], *, signing_key=None) -> None:
    """Store ``files`` (name -> bytes, names from :data:`MODEL_FILE_PATTERNS`) as the run's model files, replacing
    earlier ones: the files first, the (signed) index last. ``signing_key`` as for the publisher (None: from
    ``SYNCD_SIGNING_KEY``; False: unsigned). Raises ``ValueError`` for a name or size outside the limits and
    :class:`~syncd.errors.StoreError`."""
    store = Store.open(store)
    for name, data in files.items():
        if not _NAME_RE.match(name) or len(data) > MAX_FILE_BYTES:
            raise ValueError(f"model file {name!r} ({len(data)} bytes): not a model file name or over "
                             f"{MAX_FILE_BYTES} bytes")
    key = resolve_key(signing_key)
    body = {"run_id": mf.check_run_id(run_id),
            "files": {n: {"bytes": len(d), "sha256": hashlib.sha256(d).hexdigest()} for n, d in sorted(files.items())}}
    for name, data in files.items():
        store.put(_prefix(run_id) + "files/" + name, data)
    doc = dict(body, signature=signature_for(_message(body), key) if key is not None else None)
    store.put(_prefix(run_id) + "index.json", mf._canonical(doc))
    log.info("run %s: stored model files %s", run_id, ", ".join(sorted(files)))


def get_model_files(store, run_id: str, *, signing_key=None) -> dict[str, bytes]:
    """The run's model files, each checked against the index (``{}`` when the run has none). A signed index is
    checked as a manifest is (:func:`syncd.signing.check_signature`); raises :class:`~syncd.errors.ManifestError`
    (or its :class:`~syncd.errors.SignatureError`) for a bad index, :class:`~syncd.errors.IntegrityError` for a
    file that does not match it, :class:`~syncd.errors.StoreError`."""
    store = Store.open(store, create=False)
    where = f"run {run_id!r} model files index"
    try:
        raw = store.get_bounded(_prefix(run_id) + "index.json", MAX_INDEX_BYTES)
    except ObjectNotFound:
        return {}
    doc = jsonsafe.loads(raw, what=where, max_bytes=MAX_INDEX_BYTES, floats=False, unique_members=True,
                         error=ManifestError)
    if not isinstance(doc, dict) or set(doc) != {"run_id", "files", "signature"} or not isinstance(doc["files"], dict):
        raise ManifestError(f"{where}: expected an object with run_id, files and signature")
    body = {"run_id": doc["run_id"], "files": doc["files"]}
    key, allow_unsigned = resolve_policy(signing_key)
    check_signature(_message(body), doc["signature"], key, where, allow_unsigned=allow_unsigned)
    if doc["run_id"] != run_id:
        raise ManifestError(f"{where}: it names run {str(doc['run_id'])[:128]!r}")
    out = {}
    for name, info in doc["files"].items():
        if (not isinstance(name, str) or not _NAME_RE.match(name) or not isinstance(info, dict)
                or not isinstance(info.get("bytes"), int) or not 0 <= info["bytes"] <= MAX_FILE_BYTES
                or not isinstance(info.get("sha256"), str)):
            raise ManifestError(f"{where}: bad entry {str(name)[:64]!r}")
        data = store.get_bounded(_prefix(run_id) + "files/" + name, MAX_FILE_BYTES)
        if len(data) != info["bytes"] or hashlib.sha256(data).hexdigest() != info["sha256"]:
            raise IntegrityError(f"{where}: {name} does not match its digest (altered or half-written)")
        out[name] = bytes(data)
    return out


def write_folder(weights: dict, out, files: dict[str, bytes], *, max_shard_bytes: int = 5 << 30,
                 metadata: dict | None = None) -> list[Path]:
    """Write ``weights`` (name -> CPU tensor) and ``files`` (must hold ``config.json``) as a Hugging Face model
    folder at ``out``, which must not exist or be empty. One ``model.safetensors`` when the weights fit in
    ``max_shard_bytes``, else ``model-0000N-of-0000M.safetensors`` shards in ``weights`` order with
    ``model.safetensors.index.json``. Written into a sibling temporary folder and renamed into place, so ``out``
    is either complete or absent; the folder and its files get the modes a new folder and file get under the
    process's umask (not the temporary folder's 0700). ``config.json`` is written with the weights' dtype
    (``torch_dtype``, and ``dtype`` where it has one: a trainer's fp32 config says bfloat16 for the bf16 weights a
    run publishes). Returns the weight files written. Raises ``ValueError`` (no config, ``out`` not empty) and
    ``OSError``."""
    from safetensors.torch import save_file

    out = Path(out)
    if "config.json" not in files:
        raise ValueError("no config.json for the folder")
    files = {**files, "config.json": _config_with_dtype(files["config.json"], weights)}
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out}: exists and is not an empty directory (nothing was written)")
    groups, size = [[]], 0
    for name, t in weights.items():
        n = t.numel() * t.element_size()
        if groups[-1] and size + n > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    names = (["model.safetensors"] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        meta = {"format": "pt", **{k: str(v) for k, v in (metadata or {}).items()}}
        for fname, group in zip(names, groups):
            save_file({k: weights[k].contiguous() for k in group}, str(tmp / fname), metadata=meta)
        if len(groups) > 1:
            index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in weights.values())},
                     "weight_map": {k: f for f, g in zip(names, groups) for k in g}}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        mask = _umask()
        for f in tmp.iterdir():
            f.chmod(0o666 & ~mask)
        tmp.chmod(0o777 & ~mask)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return [out / n for n in names]


def _config_with_dtype(config: bytes, weights: dict) -> bytes:
    """``config.json`` naming the dtype most of ``weights``' floating-point bytes are in (unchanged when it is not
    a JSON object or the weights hold no floating-point tensor)."""
    sizes: dict = {}
    for t in weights.values():
        if t.is_floating_point():
            sizes[t.dtype] = sizes.get(t.dtype, 0) + t.numel() * t.element_size()
    try:
        doc = json.loads(config)
    except ValueError:
        return config
    if not sizes or not isinstance(doc, dict):
        return config
    name = str(max(sizes, key=sizes.get)).removeprefix("torch.")
    keys = [k for k in ("torch_dtype", "dtype") if k in doc] or ["torch_dtype"]
    if all(doc.get(k) == name for k in keys):
        return config
    doc.update({k: name for k in keys})
    return (json.dumps(doc, indent=2, sort_keys=False) + "\n").encode()


def _umask() -> int:
    """This process's umask (read from /proc where it can be, so no other thread sees it changed)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def materialize_folder(store, run_id: str, version: int | None, out, *, config_from=None, signing_key=None,
                       max_shard_bytes: int = 5 << 30) -> dict:
    """Version ``version`` (None: the latest) of ``run_id`` as a Hugging Face folder at ``out`` (see
    :func:`write_folder`), the weights rebuilt and verified by :func:`syncd.versions.materialize`. The model
    files come from ``config_from`` (a model folder) when given, else from the run's stored model files.
    Returns ``{"version", "out", "weight_files", "model_files", "tensors", "bytes"}``. Raises what
    ``materialize`` raises, and ``ValueError`` when there is no config (naming ``--config-from``)."""
    from syncd.versions import latest_version, materialize

    store = Store.open(store, create=False)
    if config_from is not None:
        files = collect_model_files(config_from)
    else:
        files = get_model_files(store, run_id, signing_key=signing_key)
        if "config.json" not in files:
            raise ValueError(f"run {run_id!r} has no stored model files (its publisher was not given the model "
                             "folder): give --config-from MODEL_DIR, the folder the trainer started from")
    if version is None:
        version = latest_version(store, run_id, signing_key=signing_key)
        if version is None:
            raise VersionNotFound(f"run {run_id!r} has no versions in {store.url}")
    weights = materialize(store, run_id, version, signing_key=signing_key)
    written = write_folder(weights, out, files, max_shard_bytes=max_shard_bytes,
                           metadata={"syncd_run_id": run_id, "syncd_version": version})
    return {"version": version, "out": str(out), "weight_files": [p.name for p in written],
            "model_files": sorted(files), "tensors": len(weights),
            "bytes": sum(t.numel() * t.element_size() for t in weights.values())}
