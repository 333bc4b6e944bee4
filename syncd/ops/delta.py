"""Lossless weight deltas: the public codec surface (formats 1 and 2, ``docs/delta-format.md``).

``encode(old, new) -> bytes`` makes a blob from which ``decode(old, blob)`` / ``apply_(old, blob)`` reproduce
``new`` bit for bit. Every backend writes blobs every other backend reads; for the same input the CPU,
GPU and reference encoders write the same bytes. ``version=2`` writes format 2, which models each element
on its old value (0.7-0.8x the size of format 1 on real deltas, and faster on dense ones); its blobs need the
base tensor to decode (``changes(blob, base=...)``), format 1's do not.

Blobs are hostile input: a truncated, altered, oversized or mismatched blob (wrong dtype, shape or base)
raises :class:`syncd.errors.DeltaError` saying what is wrong, and ``apply_`` leaves the target unchanged
when it raises. Thread-safety: calls are independent; don't apply to the same tensor from two threads.

This module holds the whole-tensor ops and their kernels; the change-list ops (``Changes``, ``changes``,
``needs_base``, ``apply_changes_``, ``changed_words``) are ``syncd/ops/_changes.py``, the host half of the codec
(header, entropy coding, context facts) ``syncd/ops/_blob.py``, and the reference kernels
``syncd/ops/reference/backend.py``.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from syncd.errors import DeltaError
from syncd.ops import _backend, _context
from syncd.ops import _format as fmt
from syncd.ops._blob import header, native_call, pack, plain, unpack
from syncd.ops._changes import Changes, apply_changes_, base_classes, changed_words, changes, needs_base
from syncd.ops._dispatch import dispatch, kernel, kernel_of, register, resolve
from syncd.ops._sections import V1_SECTIONS, V2_SECTIONS, sections
from syncd.ops._tensors import byte_view, raw_ptr, shape_of

__all__ = ["encode", "decode", "apply_", "inspect", "encode_many", "apply_many", "Changes", "changes", "base_classes",
           "needs_base", "apply_changes_", "changed_words", "find_changes", "DEFAULT_BLOCK_LOG2", "DEFAULT_FORMAT",
           "FORMAT_VERSIONS", "dtype_format"]

#: format facts tools and benchmarks use (the format itself, ``syncd.ops._format``, is private to the ops)
DEFAULT_BLOCK_LOG2 = fmt.DEFAULT_BLOCK_LOG2
DEFAULT_FORMAT = fmt.DEFAULT_FORMAT
FORMAT_VERSIONS = fmt.FORMAT_VERSIONS
dtype_format = fmt.dtype_of


def _check_pair(old: torch.Tensor, new: torch.Tensor) -> fmt.DType:
    if old.dtype != new.dtype:
        raise DeltaError(f"old and new differ in dtype: {old.dtype} vs {new.dtype}")
    if old.shape != new.shape:
        raise DeltaError(f"old and new differ in shape: {tuple(old.shape)} vs {tuple(new.shape)}")
    if old.device != new.device:
        raise DeltaError(f"old and new are on different devices: {old.device} vs {new.device}")
    return fmt.dtype_of(old.dtype)


def _check_version(version: int) -> None:
    if version not in fmt.FORMAT_VERSIONS:
        raise DeltaError(f"unknown delta format version {version!r} (known: {', '.join(map(str, fmt.FORMAT_VERSIONS))})")


def encode(old: torch.Tensor, new: torch.Tensor, *, backend: str = "auto",
           block_log2: int = fmt.DEFAULT_BLOCK_LOG2, version: int = fmt.DEFAULT_FORMAT) -> bytes:
    """Blob that takes ``old`` to ``new`` (same dtype, shape and device; any layout).

    ``block_log2`` sets the elements per independent block (2**8 .. 2**26); ``version`` the format (1 or 2).
    On a GPU the changed-word scan runs on the device and only the compact change list (and, for format 2,
    the classes of the old elements, half a byte each) is copied to the host for entropy coding.
    Raises ``DeltaError`` for mismatched inputs, an unsupported dtype or an unknown version,
    ``BackendUnavailable`` for a backend that cannot run here.
    """
    dt = _check_pair(old, new)
    _check_version(version)
    if not fmt.MIN_BLOCK_LOG2 <= block_log2 <= fmt.MAX_BLOCK_LOG2:
        raise DeltaError(f"block_log2 {block_log2} outside {fmt.MIN_BLOCK_LOG2}..{fmt.MAX_BLOCK_LOG2}")
    return dispatch("encode", backend, old.device.type)(old, new, dt, shape_of(old), block_log2, version)


@kernel("encode", "cpu")
def _encode_cpu(old, new, dt, shape, block_log2, version) -> bytes:
    return _native_encode(old, new, dt, shape, block_log2, _backend.threads(), version)


def _encode_gpu(name, old, new, dt, shape, block_log2, version) -> bytes:
    k = _backend.gpu_kernels(name)
    o, n = old.detach().contiguous(), new.detach().contiguous()
    pos, v = k.find_changes(o, n, dt.bits, dt.is_float)
    base_ck, new_ck = k.checksum(o), k.checksum(n)
    context = None
    if version == 2:
        nib, e_tops = _context.class_nibbles(o, dt, block_log2)
        context = (nib.cpu().numpy(), e_tops.cpu().tolist())
    return pack(dt, shape, block_log2, pos.cpu().numpy().view(np.uint64), v.cpu().numpy().view(np.uint64),
                base_ck, new_ck, version, context)


def find_changes(old: torch.Tensor, new: torch.Tensor, *, backend: str = "auto"):
    """The changed-word scan of :func:`encode` on its own: ``(positions, values)``, int64 tensors on ``old``'s
    device -- ascending flat positions of the elements that differ and their coded changes
    (``docs/delta-format.md``). Backends ``reference``, ``cuda``, ``triton`` (the CPU encoder fuses the scan
    into its native pass). Raises ``DeltaError`` for mismatched inputs, ``BackendUnavailable``."""
    dt = _check_pair(old, new)
    scan = dispatch("find_changes", backend, old.device.type)
    return scan(old.detach().contiguous(), new.detach().contiguous(), dt)


def _native_encode(old, new, dt, shape, block_log2, threads, version) -> bytes:
    po, pn = raw_ptr(old), raw_ptr(new)
    if po is not None and pn is not None:
        return native_call(_backend.native().encode_ptr, po, pn, dt.code, shape, block_log2, threads, version)
    return native_call(_backend.native().encode, byte_view(old), byte_view(new), dt.code, shape, block_log2, threads,
                       version)


def _native_apply(tensor, blob, dt, shape, verify, threads) -> None:
    ptr = raw_ptr(tensor)
    if ptr is not None:
        native_call(_backend.native().apply_ptr, ptr, blob, dt.code, shape, verify, threads)
    else:
        native_call(_backend.native().apply, byte_view(tensor), blob, dt.code, shape, verify, threads)


def apply_(tensor: torch.Tensor, blob, *, backend: str = "auto", verify: bool = True) -> None:
    """Apply ``blob`` to ``tensor`` in place, turning the encoder's ``old`` into its ``new``.

    With ``verify`` (the default) the tensor's checksum must equal the blob's base checksum and the result
    must equal the blob's new checksum. ``verify=False`` skips the checksums of the tensor but still checks
    the blob's own integrity. Raises ``DeltaError``; the tensor is then as it was before the call (the CPU
    and GPU backends write as they go and restore every written element before raising, so another thread
    reading the tensor during the call can see a partial update; engines apply while paused).
    """
    dt = fmt.dtype_of(tensor.dtype)
    name = resolve("apply", backend, tensor.device.type)
    if name in ("cpu", "reference") and not tensor.is_contiguous():
        tmp = tensor.contiguous()
        apply_(tmp, blob, backend=name, verify=verify)
        with torch.no_grad():
            tensor.copy_(tmp)
        return
    kernel_of("apply", name)(tensor, blob, dt, shape_of(tensor), verify)


@kernel("apply", "cpu")
def _apply_cpu(tensor, blob, dt, shape, verify) -> None:
    _native_apply(tensor, blob, dt, shape, verify, _backend.threads())


def _apply_gpu(name: str, tensor: torch.Tensor, blob, dt: fmt.DType, shape, verify: bool) -> None:
    k = _backend.gpu_kernels(name)
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    h = header(blob)
    fmt.check_target(h, dt, shape)
    if verify:  # first: with a wrong base, format 2's context blocks would fail to decode
        have = k.checksum(work)
        if have != h.base_checksum:
            raise DeltaError(f"wrong base: blob expects base checksum {h.base_checksum:#018x}, target has {have:#018x}")
    pos, v, base_ck, new_ck = unpack(blob, h, dt, shape, work)
    if not len(pos):
        return
    # pageable copies: pinning a fresh buffer per call costs more than it saves
    pos_d = torch.from_numpy(pos.view(np.int64)).to(work.device)
    v_d = torch.from_numpy(v.view(np.int64)).to(work.device)
    k.scatter_apply(work, pos_d, v_d, dt.bits, dt.is_float, forward=True)
    if verify and k.checksum(work) != new_ck:
        k.scatter_apply(work, pos_d, v_d, dt.bits, dt.is_float, forward=False)
        raise DeltaError("result checksum mismatch: the decoded tensor differs from the encoder's")
    if work is not tensor:
        with torch.no_grad():
            tensor.copy_(work)


for _gpu in ("cuda", "triton"):
    register("encode", _gpu, functools.partial(_encode_gpu, _gpu))
    register("apply", _gpu, functools.partial(_apply_gpu, _gpu))
    register("find_changes", _gpu, lambda old, new, dt, _name=_gpu: _backend.gpu_kernels(_name).find_changes(
        old, new, dt.bits, dt.is_float))


def encode_many(olds, news, *, backend: str = "auto", block_log2: int = fmt.DEFAULT_BLOCK_LOG2,
                version: int = fmt.DEFAULT_FORMAT) -> list[bytes]:
    """``[encode(o, n) for o, n in zip(olds, news)]``, using every core across tensors as well as within
    them (CPU backend); the blobs are identical to ``encode``'s."""
    olds, news = list(olds), list(news)
    _check_version(version)
    if len(olds) != len(news):
        raise DeltaError(f"{len(olds)} old tensors but {len(news)} new ones")
    if not olds or any(t.device.type != "cpu" for t in olds) or resolve("encode", backend, "cpu") != "cpu":
        return [encode(o, n, backend=backend, block_log2=block_log2, version=version) for o, n in zip(olds, news)]

    keep, items = [], []  # every block of every tensor goes to one native pool
    for o, n in zip(olds, news):
        dt = _check_pair(o, n)
        o, n = plain(o), plain(n)
        keep += (o, n)
        items.append((o.data_ptr(), n.data_ptr(), dt.code, shape_of(o)))
    return native_call(_backend.native().encode_many_ptr, items, block_log2, _backend.threads(), version)


def apply_many(tensors, blobs, *, backend: str = "auto", verify: bool = True) -> None:
    """``apply_`` over pairs, using every core across tensors as well as within them (CPU backend). Each
    tensor is checked and written independently: on an error, the tensors whose blobs were good are updated,
    the failing one is unchanged, and the first ``DeltaError`` is raised after all have run."""
    tensors, blobs = list(tensors), list(blobs)
    if len(tensors) != len(blobs):
        raise DeltaError(f"{len(tensors)} tensors but {len(blobs)} blobs")
    if (not tensors or any(raw_ptr(t) is None for t in tensors)
            or resolve("apply", backend, "cpu") != "cpu"):
        for t, b in zip(tensors, blobs):
            apply_(t, b, backend=backend, verify=verify)
        return

    errors: list = [None] * len(tensors)
    items, where = [], []  # every block of every tensor goes to one native pool
    for i, (t, b) in enumerate(zip(tensors, blobs)):
        try:
            items.append((t.data_ptr(), b, fmt.dtype_of(t.dtype).code, shape_of(t)))
            where.append(i)
        except DeltaError as e:
            errors[i] = e
    for i, m in zip(where, native_call(_backend.native().apply_many_ptr, items, verify, _backend.threads())):
        errors[i] = DeltaError(m) if m else None
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first


def decode(old: torch.Tensor, blob, *, backend: str = "auto", verify: bool = True) -> torch.Tensor:
    """A new tensor equal to the encoder's ``new``, bit for bit; ``old`` is not modified."""
    out = old.detach().clone(memory_format=torch.contiguous_format)
    apply_(out, blob, backend=backend, verify=verify)
    return out


def inspect(blob) -> dict:
    """Facts of a blob without decoding its changes: dtype, shape, changed count, format version, block size,
    base and new checksums, and section sizes in bytes. Format 1: frequency tables, length fields, raw bits
    and rANS streams; format 2 adds the mode bytes, context blocks' parameters, position and value streams,
    mantissa and sign bits (``context_blocks`` counts them). Raises ``DeltaError`` for a malformed header or
    section layout."""
    h = header(blob)
    payload = sum(b[0] for b in h.blocks)
    sizes = dict.fromkeys(V1_SECTIONS if h.version == 1 else V2_SECTIONS, 0)
    data = memoryview(blob).cast("B")
    off, context_blocks = h.header_bytes, 0
    for b, (plen, nchg, _) in enumerate(h.blocks):
        if plen:
            part = bytes(data[off : off + plen])
            context_blocks += h.version == 2 and part[0] in fmt.CONTEXT_MODES
            for k, n in sections(part, h.version, nchg, f"block {b}").items():
                sizes[k] += n
        off += plen
    return {
        "format_version": h.version,
        "dtype": h.dtype.name,
        "shape": tuple(h.shape),
        "numel": h.numel,
        "changed": h.n_changed,
        "density": (h.n_changed / h.numel) if h.numel else 0.0,
        "block_elems": h.block_elems,
        "blocks": len(h.blocks),
        "context_blocks": context_blocks,
        "header_bytes": h.header_bytes,
        "payload_bytes": payload,
        "total_bytes": h.header_bytes + payload,
        "sections": sizes,
        "base_checksum": h.base_checksum,
        "new_checksum": h.new_checksum,
    }
