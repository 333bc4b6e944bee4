"""The shards of one version being written (:class:`ShardWriter`, ``syncd.publish.WeightPublisher``'s helper): full
versions as safetensors files, deltas as concatenated codec blobs, each shard uploaded while the next is built.
The layout and the manifest entries are ``syncd.manifest``'s (``docs/layout.md``)."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import struct
from typing import Callable

import torch

from syncd import manifest as mf

log = logging.getLogger("syncd.publish.publisher")

__all__ = ["ShardWriter", "delta_formats"]


def delta_formats(delta_format: int = 1, sliced_tensors: str | None = None) -> Callable[[str], int]:
    """The codec format of each trainer tensor's deltas, by name: ``delta_format`` (1 or 2), except that with 2
    the names that ``sliced_tensors`` (a regular expression, ``re.fullmatch``) matches stay in format 1.

    Format 2 codes each element's change on its old exponent: about 0.75x the bytes of format 1, and faster to
    encode and apply from a few percent changed words on, a little slower below (``python -m bench.codec``).
    Its context blocks decode only with the whole old tensor at hand, which an engine holding a tensor-parallel
    slice of it lacks (``syncd.engine.WeightUpdater`` refuses such a blob, naming the tensor); fused parameters hold
    their sources whole and are fine. Readers take both formats in any mix. Raises ValueError naming the bad
    argument."""
    if delta_format not in (1, 2) or isinstance(delta_format, bool):
        raise ValueError(f"delta_format must be 1 or 2, got {delta_format!r}")
    if sliced_tensors is None or delta_format == 1:
        return lambda name: delta_format
    try:
        sliced = re.compile(sliced_tensors)
    except (re.error, TypeError) as exc:
        raise ValueError(f"sliced_tensors {sliced_tensors!r} is not a regular expression: {exc}") from None
    return lambda name: 1 if sliced.fullmatch(name) else 2


class ShardWriter:
    """Builds one version's shards and uploads them in parallel while later shards are still being built
    (at most ``upload_threads`` shards in memory at once). ``pub``: the :class:`~syncd.publish.publisher.WeightPublisher`
    whose store, session, pool and settings it uses; used from its publishing thread."""

    def __init__(self, pub, version: int, kind: str):
        self.pub, self.version, self.kind = pub, version, kind
        self.prefix = mf.run_prefix(pub.run_id)
        self.pending: list = []  # (name, tensor) for full; (name, dtype, shape, blob, checksum) for delta
        self.pending_bytes = 0
        self.futures: list = []
        self.shards: list[mf.ShardEntry] = []
        self.tensors: list[mf.TensorEntry] = []

    def add_full(self, name: str, t: torch.Tensor) -> None:
        from syncd.ops import checksum

        self._add((name, t.detach().cpu().contiguous(), checksum(t, backend=self.pub.backend)),
                  t.numel() * t.element_size())

    def add_deltas(self, names: list, olds: list, news: list) -> None:
        """Encode a batch of tensors at once (all cores across and within tensors, one call per codec format)
        and add their blobs in ``names``' order."""
        from syncd.ops import delta

        blobs: list = [None] * len(names)
        formats = [self.pub.delta_format_of(n) for n in names]
        for version in sorted(set(formats)):
            idx = [i for i, f in enumerate(formats) if f == version]
            got = delta.encode_many([olds[i] for i in idx], [news[i] for i in idx], backend=self.pub.backend,
                                    version=version)
            for i, blob in zip(idx, got):
                blobs[i] = blob
        for name, new, blob in zip(names, news, blobs):
            info = delta.inspect(blob)
            self._add((name, str(new.dtype).removeprefix("torch."), tuple(new.shape), blob,
                       info["new_checksum"]), len(blob))

    def _add(self, item, nbytes: int) -> None:
        """Shards hold at most ``shard_bytes`` of tensor data, or a single larger tensor."""
        if self.pending and self.pending_bytes + nbytes > self.pub.shard_bytes:
            self._cut()
        self.pending.append(item)
        self.pending_bytes += nbytes
        if self.pending_bytes >= self.pub.shard_bytes:
            self._cut()

    def _cut(self) -> None:
        if not self.pending:
            return
        index = len(self.shards)
        key = mf.shard_key(self.version, self.pub.session, index, self.kind)
        if self.kind == "full":
            data, entries = _safetensors_shard(self.pending, index, self.pub.run_id, self.version)
        else:
            data, entries, off = bytearray(), [], 0
            for name, dtype, shape, blob, ck in self.pending:
                entries.append(mf.TensorEntry(name, dtype, shape, index, off, len(blob), ck))
                data += blob
                off += len(blob)
        self.tensors += entries
        self.shards.append(mf.ShardEntry(key, len(data), hashlib.sha256(data).hexdigest(),
                                         mf.SHARD_FORMATS[self.kind]))
        self.pending, self.pending_bytes = [], 0
        while len([f for f in self.futures if not f.done()]) >= self.pub._upload_threads:
            next(f for f in self.futures if not f.done()).result()
        self.futures.append(self.pub._pool.submit(self.pub.store.put, self.prefix + key, data))

    def finish(self):
        """Cut the last shard, wait for every upload; raises the first upload error."""
        self._cut()
        for f in self.futures:
            f.result()
        return self.shards, self.tensors

    def discard(self) -> None:
        """Best-effort removal of this attempt's shards after a failure (retention catches the rest)."""
        for f in self.futures:
            f.cancel()
        try:
            for f in self.futures:
                if not f.cancelled():
                    f.exception()
            self.pub.store.delete([self.prefix + s.key for s in self.shards])
        except Exception as exc:  # noqa: BLE001
            log.debug("could not remove the shards of a failed version: %s", exc)


def _safetensors_shard(items, index: int, run_id: str, version: int):
    """One safetensors file holding ``items`` [(name, cpu tensor, checksum)] and its manifest entries
    (offsets are absolute byte positions of each tensor's data in the file)."""
    from safetensors.torch import save

    data = save({n: t for n, t, _ in items},
                metadata={"format": "pt", "syncd_run_id": run_id, "syncd_version": str(version)})
    (hlen,) = struct.unpack_from("<Q", data, 0)
    header = json.loads(data[8:8 + hlen])
    entries = []
    for name, t, ck in items:
        begin, end = header[name]["data_offsets"]
        entries.append(mf.TensorEntry(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), index,
                                      8 + hlen + begin, end - begin, ck))
    return data, entries
