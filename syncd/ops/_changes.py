"""The sparse content of a delta blob (``delta.changes``): which elements change and how, for engines whose local
parameter is a slice or part of a fused tensor, and the checks of ``delta.changed_words``, which stage such a change
against a base held whole without a scratch copy. Public through :mod:`syncd.ops.delta`.

Raises ``DeltaError`` for malformed blobs and change lists (the module docstring of :mod:`syncd.ops.delta`).
Thread-safe: calls are independent.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from syncd.errors import DeltaError
from syncd.ops import _backend
from syncd.ops import _checksum_math as cm
from syncd.ops import _format as fmt
from syncd.ops._bits import apply_values
from syncd.ops._blob import base_nibbles, check_base, context_e_tops, header, native_call, unpack
from syncd.ops._checksum import checksum
from syncd.ops._dispatch import dispatch, kernel
from syncd.ops._tensors import even_stride, int_view

__all__ = ["Changes", "changes", "base_classes", "needs_base", "apply_changes_", "changed_words"]


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


def needs_base(blob) -> bool:
    """Whether decoding ``blob`` needs the tensor it applies to: a format-2 blob with a context block, whose
    element classes come from the old values (``changes(blob, base=...)``; ``apply_`` and ``decode`` always
    have it). Reads the header and each block's first bytes only. Raises ``DeltaError`` for a malformed header
    or block table."""
    return context_e_tops(blob, header(blob)) is not None


def base_classes(blob, base: torch.Tensor) -> torch.Tensor | None:
    """What decoding ``blob`` needs of ``base`` (the tensor it applies to): the classes of its elements, on
    ``base``'s device (uint8, two per byte: element ``2i`` in the low nibble of byte ``i``), or None when the blob has
    no context block. A GPU computes them where the base lives, and only these half bytes per element cross to the
    host decoder (``changes(blob, classes=...)``); ``changes(blob, base=gpu_tensor)`` does exactly that. Raises
    ``DeltaError`` for a malformed blob or a base of another dtype or shape."""
    h = header(blob)
    e_tops = context_e_tops(blob, h)
    return None if e_tops is None else base_nibbles(blob, h, base, e_tops)


def changes(blob, base: torch.Tensor | None = None, *, classes: torch.Tensor | None = None) -> Changes:
    """Parse and fully validate ``blob`` (every block checksum) into its change list. A format-2 blob's
    context blocks need ``base``, the tensor the blob applies to (any device; only read, and only when the
    blob has context blocks: a caller that holds the base may always pass it), or ``classes``, what
    :func:`base_classes` gives for it (then ``base`` is not read). Raises ``DeltaError`` (also for a context block
    without either, a base of another dtype or shape, or classes of another length than ceil(numel / 2) bytes)."""
    h = header(blob)
    torch_dtype = getattr(torch, h.dtype.name)
    nibbles = None
    if classes is not None:
        want = (h.numel + 1) // 2
        if classes.dtype != torch.uint8 or classes.dim() != 1 or classes.numel() != want:
            raise DeltaError(f"classes must be a 1-D uint8 tensor of {want} bytes (base_classes), got "
                             f"{str(classes.dtype).removeprefix('torch.')}{list(classes.shape)}")
        nibbles, base = classes.detach().cpu().contiguous().numpy(), None
    e_tops = context_e_tops(blob, h) if base is not None else None
    if e_tops is None:
        base = None  # no context block: the base would only be checked (and a strided one copied) for nothing
    pos, v, base_ck, new_ck = unpack(blob, h, h.dtype, tuple(h.shape), base, e_tops, nibbles)
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
    new = apply_values(old, values.numpy().view(np.uint64), dt)
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
    check_base(base, ch.dtype, ch.shape)
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
    old, new, adj = dispatch("changed_words", "auto", "cpu")(dt, words, old_w, pos, values, first)
    raw = (cm.raw_of(ch.base_checksum, nbytes) + adj) & cm.MASK64
    if cm.finalize(raw, nbytes) != ch.new_checksum:
        raise DeltaError("result checksum mismatch: the decoded tensor differs from the encoder's")
    signed = np.dtype(f"i{dt.itemsize}")
    return torch.from_numpy(old.view(signed)), torch.from_numpy(new.view(signed))


@kernel("changed_words", "cpu")
def _changed_words_cpu(dt: fmt.DType, words, old_w, pos, values, first) -> tuple[np.ndarray, np.ndarray, int]:
    """``(old, new, adj)``: the element bits at ``pos`` before and after ``values``, read from the changed words
    ``old_w`` (at word indices ``words``; ``first`` marks each position that opens a word), and what the checksum's
    raw sum gains (``csrc/cpu/changed_words.h``). Raises ``DeltaError`` for a malformed change list."""
    return native_call(_backend.native().changed_words, dt.code, words, old_w, pos, values)


def _words_at(flat: torch.Tensor, words: np.ndarray, nbytes: int, dt: fmt.DType) -> np.ndarray:
    """The 64-bit words ``words`` (ascending indices) of the bytes of ``flat`` (1-D, any layout, any device),
    zero-padded past ``nbytes``, as a uint64 array on the host."""
    index = torch.from_numpy(words.view(np.int64))
    if flat.is_contiguous() and nbytes % 8 == 0 and (flat.storage_offset() * dt.itemsize) % 8 == 0:
        return flat.view(torch.int64)[index.to(flat.device)].cpu().numpy().view(np.uint64)
    stride = even_stride(flat)  # a strided CPU view (bf16 halves of fp32) or a partial last word: read in place
    if stride is not None and flat.numel() and _backend.available("cpu", "cpu") is None:
        return native_call(_backend.native().words_at_ptr, flat.data_ptr(), flat.numel(), dt.itemsize, stride, words,
                           _backend.threads())
    per_word = 64 // dt.bits  # element by element: a last word past the tensor's end, or an unaligned view
    elems = index[:, None] * per_word + torch.arange(per_word)
    got = int_view(flat)[elems.clamp(max=max(flat.numel() - 1, 0)).to(flat.device)].cpu()
    return np.ascontiguousarray(torch.where(elems < flat.numel(), got, 0).numpy()).view(np.uint64).reshape(-1)
