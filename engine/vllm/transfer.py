"""How an :class:`~syncd.engines.update.Update` reaches vLLM's worker process: as a small plain-data reference
that crosses ``collective_rpc`` (msgpack), never the bytes themselves.

* An update of a version in the node cache (``Update.from_cache``, what the daemon hands every engine) is sent
  as the manifest's exact bytes and the cache root; the worker reads the shards itself, re-hashing each one
  (``syncd.cache.read_shards``), exactly as an engine process behind the control routes does.
* An update held in memory (``Update.from_shards``, a test's) is written once to a safetensors file in
  ``/dev/shm`` (delta blobs as uint8 tensors; the version, kind, base version and checksums in the metadata),
  read by the worker and deleted by the front end once the worker is done with it.

Pure functions; the caller owns the files it is handed (:func:`update_ref` returns the path to delete).
"""

from __future__ import annotations

import json
import os
import tempfile

import torch

from syncd.engines.update import Update

__all__ = ["update_ref", "update_from_ref"]


def _tmp_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def update_ref(update: Update) -> tuple[dict, str | None]:
    """``(ref, path)``: the reference to send for ``update`` and the file the caller deletes afterwards
    (None when nothing was written)."""
    src = update.source
    if src is not None and src.raw is not None:
        return {"kind": "cache", "manifest": bytes(src.raw), "cache_root": src.cache_root,
                "verify_shards": bool(src.verify_shards), "threads": int(src.threads)}, None
    from safetensors.torch import save_file

    tensors = {}
    for name, v in update.tensors.items():
        if update.kind == "delta":
            tensors[name] = torch.frombuffer(bytearray(bytes(v)), dtype=torch.uint8)
        else:
            tensors[name] = v.detach().cpu().contiguous()
    meta = {"version": update.version, "kind": update.kind, "base_version": update.base_version,
            "checksums": {k: str(int(c)) for k, c in update.checksums.items()}}
    fd, path = tempfile.mkstemp(prefix="syncd-vllm-update-", suffix=".safetensors", dir=_tmp_dir())
    os.close(fd)
    try:
        save_file(tensors, path, metadata={"syncd": json.dumps(meta)})
    except BaseException:
        os.unlink(path)
        raise
    return {"kind": "file", "path": path}, path


def update_from_ref(ref: dict) -> Update:
    """The :class:`Update` a reference of :func:`update_ref` stands for (in the worker process). Raises
    ``ValueError`` for a reference that is not one, and what reading raises (``ManifestError``,
    ``IntegrityError``, ``FileNotFoundError``)."""
    kind = ref.get("kind") if isinstance(ref, dict) else None
    if kind == "cache":
        return Update.from_cache(bytes(ref["manifest"]), ref["cache_root"], verify_shards=bool(ref["verify_shards"]),
                                 threads=int(ref["threads"]))
    if kind == "file":
        from safetensors import safe_open

        with safe_open(ref["path"], framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("syncd", "null") or "null")
            if not isinstance(meta, dict):
                raise ValueError(f"{ref['path']}: not a syncd update file (no 'syncd' metadata)")
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        if meta["kind"] == "delta":
            tensors = {k: memoryview(t.numpy()) for k, t in tensors.items()}
        return Update(int(meta["version"]), meta["kind"], tensors, meta["base_version"],
                      {k: int(c) for k, c in meta["checksums"].items()})
    raise ValueError(f"not an update reference: {ref!r:.200}")
