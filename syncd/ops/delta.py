"""Lossless weight deltas: the public codec surface (formats 1 and 2, ``docs/delta-format.md``).

``encode(old, new) -> bytes`` makes a blob from which ``decode(old, blob)`` / ``apply_(old, blob)`` reproduce
``new`` bit for bit. Every backend writes blobs every other backend reads; for the same input the CPU,
GPU and reference encoders write the same bytes. ``version=2`` writes format 2, which models each element
on its old value (0.7-0.8x the size of format 1 on real deltas, and faster on dense ones); its blobs need the
base tensor to decode (``changes(blob, base=...)``), format 1's do not.

Blobs are hostile input: a truncated, altered, oversized or mismatched blob (wrong dtype, shape or base)
raises :class:`syncd.errors.DeltaError` saying what is wrong, and ``apply_`` leaves the target unchanged
when it raises. Thread-safety: calls are independent; don't apply to the same tensor from two threads.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from syncd.errors import DeltaError
from syncd.ops import _backend, _context
from syncd.ops import _format as fmt
from syncd.ops._checksum import checksum
from syncd.ops._dispatch import dispatch, kernel, kernel_of, register, resolve
from syncd.ops._tensors import byte_view, even_stride, int_view, raw_ptr, shape_of
from syncd.ops.reference import checksum as ref_ck
from syncd.ops.reference import context as ref_ctx
from syncd.ops.reference import delta as ref
from syncd.ops.reference import block_v1 as ref_v1
from syncd.ops.reference import delta_v2 as ref_v2

__all__ = ["encode", "decode", "apply_", "inspect", "encode_many", "apply_many", "Changes", "changes", "needs_base",
           "apply_changes_", "changed_words", "find_changes", "DEFAULT_BLOCK_LOG2", "DEFAULT_FORMAT", "FORMAT_VERSIONS", "dtype_format"]

#: format facts tools and benchmarks use (the format itself, ``syncd.ops._format``, is private to the ops)
DEFAULT_BLOCK_LOG2 = fmt.DEFAULT_BLOCK_LOG2
DEFAULT_FORMAT = fmt.DEFAULT_FORMAT
FORMAT_VERSIONS = fmt.FORMAT_VERSIONS
dtype_format = fmt.dtype_of


def _native_call(fn, *args):
    """Run a native entry point, turning its ValueErrors into DeltaError (same message)."""
    try:
        return fn(*args)
    except DeltaError:
        raise
    except ValueError as e:
        raise DeltaError(str(e)) from None


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


@kernel("encode", "reference")
def _encode_reference(old, new, dt, shape, block_log2, version) -> bytes:
    return ref.encode(byte_view(old.cpu()), byte_view(new.cpu()), dt, shape, block_log2, version)


def _encode_gpu(name, old, new, dt, shape, block_log2, version) -> bytes:
    k = _backend.gpu_kernels(name)
    o, n = old.detach().contiguous(), new.detach().contiguous()
    pos, v = k.find_changes(o, n, dt.bits, dt.is_float)
    base_ck, new_ck = k.checksum(o), k.checksum(n)
    context = None
    if version == 2:
        nib, e_tops = _context.class_nibbles(o, dt, block_log2)
        context = (nib.cpu().numpy(), e_tops.cpu().tolist())
    return _pack(dt, shape, block_log2, pos.cpu().numpy().view(np.uint64), v.cpu().numpy().view(np.uint64),
                 base_ck, new_ck, version, context)


def find_changes(old: torch.Tensor, new: torch.Tensor, *, backend: str = "auto"):
    """The changed-word scan of :func:`encode` on its own: ``(positions, values)``, int64 tensors on ``old``'s
    device -- ascending flat positions of the elements that differ and their coded changes
    (``docs/delta-format.md``). Backends ``reference``, ``cuda``, ``triton`` (the CPU encoder fuses the scan
    into its native pass). Raises ``DeltaError`` for mismatched inputs, ``BackendUnavailable``."""
    dt = _check_pair(old, new)
    scan = dispatch("find_changes", backend, old.device.type)
    return scan(old.detach().contiguous(), new.detach().contiguous(), dt)


@kernel("find_changes", "reference")
def _find_changes_reference(old, new, dt):
    pos, v = ref.changes(ref.bits_view(byte_view(old.cpu()), dt), ref.bits_view(byte_view(new.cpu()), dt), dt)
    return torch.from_numpy(pos).to(old.device), torch.from_numpy(v.view(np.int64)).to(old.device)


def _native_encode(old, new, dt, shape, block_log2, threads, version) -> bytes:
    po, pn = raw_ptr(old), raw_ptr(new)
    if po is not None and pn is not None:
        return _native_call(_backend.native().encode_ptr, po, pn, dt.code, shape, block_log2, threads, version)
    return _native_call(_backend.native().encode, byte_view(old), byte_view(new), dt.code, shape, block_log2, threads,
                        version)


def _native_apply(tensor, blob, dt, shape, verify, threads) -> None:
    ptr = raw_ptr(tensor)
    if ptr is not None:
        _native_call(_backend.native().apply_ptr, ptr, blob, dt.code, shape, verify, threads)
    else:
        _native_call(_backend.native().apply, byte_view(tensor), blob, dt.code, shape, verify, threads)


def _pack(dt, shape, block_log2, pos, v, base_ck, new_ck, version, context) -> bytes:
    """Entropy-code changes found elsewhere; ``context`` (format 2): (class nibbles, e_top per block)."""
    if _backend.available("cpu", "cpu") is None:
        nib, e_tops = context if context is not None else (None, [])
        return _native_call(_backend.native().pack, dt.code, shape, block_log2, pos, v, base_ck, new_ck,
                            _backend.threads(), version, nib, e_tops)
    ctx_of = None
    if context is not None:
        classes = ref_ctx.unpack_nibbles(context[0], int(np.prod(shape, dtype=np.int64)))
        ctx_of = lambda b, lo, hi: (context[1][b], classes[lo:hi])  # noqa: E731
    return ref.pack(dt, shape, block_log2, pos.astype(np.int64), v, base_ck, new_ck, version, ctx_of)


def _unpack(blob, h: fmt.Header, dt: fmt.DType, shape, base: torch.Tensor | None = None,
            e_tops: list[int] | None = None) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Positions, values and checksums of a blob (``h``: its parsed header) for a target of ``dt``/``shape``.
    ``base`` (any device) is the tensor the blob applies to; format 2's context blocks cannot be decoded without
    it. ``e_tops``: the blob's ``_block_e_tops`` if the caller has them."""
    ref.check_target(h, dt, shape)
    host = nibbles = None
    if base is not None and h.version == 2:
        _check_base(base, getattr(torch, h.dtype.name), h.shape)
        if base.device.type == "cpu":
            host = _plain(base)
        else:
            tops = torch.tensor([max(0, e) for e in (e_tops or _block_e_tops(blob))], dtype=torch.int64)
            nibbles = _context.class_nibbles(base.detach().contiguous(), dt, h.block_log2, tops)[0].cpu().numpy()
    if _backend.available("cpu", "cpu") is None:
        pos, v, base_ck, new_ck = _native_call(_backend.native().unpack, blob, dt.code, shape, _backend.threads(),
                                               host.data_ptr() if host is not None else 0, nibbles)
        return pos, v, base_ck, new_ck
    classes_of = None
    if host is not None:
        bits = ref.bits_view(byte_view(host), dt)
        classes_of = lambda b, lo, hi, e_top: ref_ctx.classes_of(bits[lo:hi], dt, e_top)  # noqa: E731
    elif nibbles is not None:
        all_cls = ref_ctx.unpack_nibbles(nibbles, int(np.prod(shape, dtype=np.int64)))
        classes_of = lambda b, lo, hi, e_top: all_cls[lo:hi]  # noqa: E731
    h, pos, v = ref.unpack(blob, classes_of)
    return pos.view(np.uint64), v, h.base_checksum, h.new_checksum


def _check_base(base: torch.Tensor, dtype: torch.dtype, shape) -> None:
    if base.dtype != dtype or tuple(base.shape) != tuple(shape):
        blob = str(dtype).removeprefix("torch.")
        raise DeltaError(f"base is {base.dtype}{list(base.shape)}, the blob is for {blob}{list(shape)}")


def needs_base(blob) -> bool:
    """Whether decoding ``blob`` needs the tensor it applies to: a format-2 blob with a context block, whose
    element classes come from the old values (``changes(blob, base=...)``; ``apply_`` and ``decode`` always
    have it). Reads the header and each block's first bytes only. Raises ``DeltaError`` for a malformed header
    or block table."""
    return _context_e_tops(blob, fmt.parse_header(blob, ref_ck.checksum_bytes)) is not None


def _context_e_tops(blob, h: fmt.Header) -> list[int] | None:
    """The blob's ``_block_e_tops`` if it has a context block (format 2), else None."""
    if h.version != 2:
        return None
    e_tops = _block_e_tops(blob)
    return e_tops if any(e >= 0 for e in e_tops) else None


def _block_e_tops(blob) -> list[int]:
    """Each block's e_top (format 2 context blocks), -1 for the others."""
    if _backend.available("cpu", "cpu") is None:
        return list(_native_call(_backend.native().block_e_tops, blob))
    h = fmt.parse_header(blob, ref_ck.checksum_bytes)
    out, off, data = [], h.header_bytes, bytes(blob)
    for plen, _, _ in h.blocks:
        e = ref_v2.read_e_top(data[off : off + plen]) if h.version == 2 else None
        out.append(-1 if e is None else e)
        off += plen
    return out


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


@kernel("apply", "reference")
def _apply_reference(tensor, blob, dt, shape, verify) -> None:
    if tensor.device.type != "cpu":
        tmp = tensor.cpu()
        ref.decode_into(byte_view(tmp), blob, dt, shape, verify)
        with torch.no_grad():
            tensor.copy_(tmp)
        return
    ref.decode_into(byte_view(tensor), blob, dt, shape, verify)


def _apply_gpu(name: str, tensor: torch.Tensor, blob, dt: fmt.DType, shape, verify: bool) -> None:
    k = _backend.gpu_kernels(name)
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    h = fmt.parse_header(blob, ref_ck.checksum_bytes)
    ref.check_target(h, dt, shape)
    if verify:  # first: with a wrong base, format 2's context blocks would fail to decode
        have = k.checksum(work)
        if have != h.base_checksum:
            raise DeltaError(f"wrong base: blob expects base checksum {h.base_checksum:#018x}, target has {have:#018x}")
    pos, v, base_ck, new_ck = _unpack(blob, h, dt, shape, work)
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
        o, n = _plain(o), _plain(n)
        keep += (o, n)
        items.append((o.data_ptr(), n.data_ptr(), dt.code, shape_of(o)))
    return _native_call(_backend.native().encode_many_ptr, items, block_log2, _backend.threads(), version)


def _plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when ``raw_ptr`` can read it, else a contiguous copy of its values."""
    return t if raw_ptr(t) is not None else t.detach().resolve_conj().resolve_neg().contiguous()


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
    for i, m in zip(where, _native_call(_backend.native().apply_many_ptr, items, verify, _backend.threads())):
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
    h = fmt.parse_header(blob, ref_ck.checksum_bytes)
    payload = sum(b[0] for b in h.blocks)
    sections = dict.fromkeys(ref_v1.SECTIONS if h.version == 1 else ref_v2.SECTIONS, 0)
    data = memoryview(blob).cast("B")
    off, context_blocks = h.header_bytes, 0
    for b, (plen, nchg, _) in enumerate(h.blocks):
        if plen:
            part = bytes(data[off : off + plen])
            what = f"block {b}"
            got = ref_v1.sections(part, what) if h.version == 1 else ref_v2.sections(part, nchg, what)
            context_blocks += h.version == 2 and part[0] in fmt.CONTEXT_MODES
            for k, n in got.items():
                sections[k] += n
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
        "sections": sections,
        "base_checksum": h.base_checksum,
        "new_checksum": h.new_checksum,
    }


@dataclass(frozen=True)
class Changes:
    """The sparse content of a blob: which elements change and how, without the base tensor.

    ``positions`` (int64, ascending) index the flattened full tensor (row-major ``shape``); ``values`` hold
    the coded change of each (``zigzag(key delta) - 1`` as int64 bits, see ``docs/delta-format.md``), which
    ``apply_changes_`` turns into new element bits from the old ones. Used by engines whose local parameter
    is a slice or part of a fused tensor: they keep the positions they own and drop the rest.
    """

    dtype: torch.dtype
    shape: tuple[int, ...]
    positions: torch.Tensor
    values: torch.Tensor
    base_checksum: int
    new_checksum: int


def changes(blob, base: torch.Tensor | None = None) -> Changes:
    """Parse and fully validate ``blob`` (every block checksum) into its change list. A format-2 blob's
    context blocks need ``base``, the tensor the blob applies to (any device; only read, and only when the
    blob has context blocks: a caller that holds the base may always pass it). Raises ``DeltaError`` (also
    for a context block without a base, or a base of another dtype or shape, when the base is needed)."""
    h = fmt.parse_header(blob, ref_ck.checksum_bytes)
    torch_dtype = getattr(torch, h.dtype.name)
    e_tops = _context_e_tops(blob, h) if base is not None else None
    if e_tops is None:
        base = None  # no context block: the base would only be checked (and a strided one copied) for nothing
    pos, v, base_ck, new_ck = _unpack(blob, h, h.dtype, tuple(h.shape), base, e_tops)
    return Changes(torch_dtype, tuple(h.shape), torch.from_numpy(np.asarray(pos).view(np.int64)),
                   torch.from_numpy(np.asarray(v).view(np.int64)), base_ck, new_ck)


def apply_changes_(flat: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """In place: ``flat[index]`` (a 1-D CPU tensor of a codec dtype; ``index`` int64 positions into it) moves
    by the coded ``values`` (from :func:`changes`, same length as ``index``). Only those elements are written.
    Raises ``DeltaError`` for mismatched lengths or an index out of range (then nothing is written)."""
    dt = fmt.dtype_of(flat.dtype)
    if flat.dim() != 1 or flat.device.type != "cpu":
        raise DeltaError("apply_changes_ needs a 1-D CPU tensor")
    if index.numel() != values.numel():
        raise DeltaError(f"{index.numel()} positions but {values.numel()} values")
    if index.numel() == 0:
        return
    idx = index.to(torch.int64)
    if int(idx.min()) < 0 or int(idx.max()) >= flat.numel():
        raise DeltaError(f"change position outside the {flat.numel()}-element tensor")
    bits = int_view(flat)
    old = bits[idx].numpy().view(dt.np_uint)
    new = ref.apply_values(old, values.numpy().view(np.uint64), dt)
    with torch.no_grad():
        bits[idx] = torch.from_numpy(np.ascontiguousarray(new).view(bits.numpy().dtype))


def changed_words(base: torch.Tensor, ch: Changes) -> tuple[torch.Tensor, torch.Tensor]:
    """The bits of ``base``'s elements at ``ch.positions`` before and after ``ch``, as 1-D CPU tensors of the
    signed integer type of the element width (int16 for bfloat16), after checking that ``ch`` takes ``base`` to
    its encoder's result: ``base``'s checksum must be the blob's base checksum (one read pass, on ``base``'s
    device), and ``base`` with those elements replaced must have the blob's result checksum, computed from the
    changed 64-bit words alone. What ``decode`` on a scratch copy checks, without the copy or a second decode
    (an engine stages a tensor it holds whole this way). ``base`` (any device, any layout) is only read.

    Raises ``DeltaError`` for a base of another dtype or shape, either checksum mismatch (the messages of
    ``apply_``), or a change list that is malformed (positions out of range or not ascending, a value too wide
    for the dtype, lengths that differ)."""
    _check_base(base, ch.dtype, ch.shape)
    dt = fmt.dtype_of(base.dtype)
    flat = base.detach().reshape(-1)  # a strided view stays one (the bf16 halves of fp32 weights): read in place
    have = checksum(flat)
    if have != ch.base_checksum:
        raise DeltaError(f"wrong base: blob expects base checksum {ch.base_checksum:#018x}, target has {have:#018x}")
    nbytes = flat.numel() * dt.itemsize
    per_word = 64 // dt.bits
    if ch.positions.numel() != ch.values.numel():
        raise DeltaError(f"{ch.positions.numel()} positions but {ch.values.numel()} values")
    positions = ch.positions.to(torch.int64)
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= flat.numel()):
        raise DeltaError(f"change position outside the {flat.numel()}-element tensor")
    pos = np.ascontiguousarray(positions.numpy()).view(np.uint64)
    values = np.ascontiguousarray(ch.values.to(torch.int64).numpy()).view(np.uint64)
    word = pos // np.uint64(per_word)
    first = np.ones(word.size, dtype=bool)
    np.not_equal(word[1:], word[:-1], out=first[1:])
    words = word[first]
    old_w = _words_at(flat, words, nbytes, dt)  # the changed 64-bit words, a copy on the host
    if _backend.available("cpu", "cpu") is None:
        old, new, adj = _native_call(_backend.native().changed_words, dt.code, words, old_w, pos, values)
    else:
        old, new, adj = _changed_words_reference(dt, words, old_w, pos, values, first)
    raw = (ref_ck.raw_of(ch.base_checksum, nbytes) + adj) & ref_ck.MASK64
    if ref_ck.finalize(raw, nbytes) != ch.new_checksum:
        raise DeltaError("result checksum mismatch: the decoded tensor differs from the encoder's")
    signed = np.dtype(f"i{dt.itemsize}")
    return torch.from_numpy(old.view(signed)), torch.from_numpy(new.view(signed))


def _changed_words_reference(dt: fmt.DType, words, old_w, pos, values, first) -> tuple[np.ndarray, np.ndarray, int]:
    """What the native ``changed_words`` computes (``csrc/cpu/changed_words.h``), for the words ``first`` marks."""
    if pos.size and np.any(pos[1:] <= pos[:-1]):
        raise DeltaError("change positions must ascend")
    if values.size and int(values.max()) > (1 << dt.bits) - 2:
        raise DeltaError(f"value change {int(values.max())} too wide for the dtype")
    per_word = 64 // dt.bits
    at = (np.cumsum(first) - 1) * per_word + (pos % np.uint64(per_word)).astype(np.int64)  # element in old_w
    old = old_w.view(dt.np_uint)[at]
    new = np.ascontiguousarray(ref.apply_values(old, values, dt))
    new_w = old_w.copy()
    new_w.view(dt.np_uint)[at] = new
    return old, new, ref_ck.raw_after(0, words, old_w, new_w)


def _words_at(flat: torch.Tensor, words: np.ndarray, nbytes: int, dt: fmt.DType) -> np.ndarray:
    """The 64-bit words ``words`` (ascending indices) of the bytes of ``flat`` (1-D, any layout, any device),
    zero-padded past ``nbytes``, as a uint64 array on the host."""
    index = torch.from_numpy(words.view(np.int64))
    if flat.is_contiguous() and nbytes % 8 == 0 and (flat.storage_offset() * dt.itemsize) % 8 == 0:
        return flat.view(torch.int64)[index.to(flat.device)].cpu().numpy().view(np.uint64)
    stride = even_stride(flat)  # a strided CPU view (bf16 halves of fp32) or a partial last word: read in place
    if stride is not None and flat.numel() and _backend.available("cpu", "cpu") is None:
        return _native_call(_backend.native().words_at_ptr, flat.data_ptr(), flat.numel(), dt.itemsize, stride, words,
                            _backend.threads())
    per_word = 64 // dt.bits  # element by element: a last word past the tensor's end, or an unaligned view
    elems = index[:, None] * per_word + torch.arange(per_word)
    got = int_view(flat)[elems.clamp(max=max(flat.numel() - 1, 0)).to(flat.device)].cpu()
    return np.ascontiguousarray(torch.where(elems < flat.numel(), got, 0).numpy()).view(np.uint64).reshape(-1)
