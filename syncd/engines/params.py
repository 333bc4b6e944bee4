"""Parameter specs: how an engine's local parameters map onto the trainer's full tensors, and the layout
helpers every side of the engine boundary uses.

An engine's local parameter (:class:`ParamSpec`) is one trainer tensor, a row or column range of one
(tensor-parallel slicing), or several fused along one dim (``qkv``, ``gate_up``), each range a
:class:`ParamPiece`. This module checks that a spec's pieces tile its local shape (:func:`check_spec`), maps
full-tensor flat positions to local ones (:func:`map_positions`), cuts a local tensor out of full ones
(:func:`build_local`) and says what each local checksum must be (:func:`expected_checksums`) -- the daemon
verifies an engine against a manifest with it, the engine's updater stages with the rest. The integer word views
the updater compares and writes through are here too (:func:`word_view`, :func:`flat_view`,
:func:`bf16_view_of_fp32`).

Pure functions over tensors the caller owns; thread-safe. Errors: ``ValueError`` for a spec or tensor that
does not fit, ``KeyError`` for a missing trainer tensor.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from syncd.ops import checksum as _checksum

__all__ = ["ParamPiece", "ParamSpec", "identity_specs", "check_spec", "check_like", "map_positions", "build_local",
           "expected_checksums", "slab", "local_slab", "word_view", "flat_view", "bf16_view_of_fp32"]


@dataclass(frozen=True)
class ParamPiece:
    """Where a range of one trainer tensor lands inside a local engine parameter.

    The trainer tensor ``source`` (full shape ``source_shape``) is cut along dimension ``dim`` to
    ``[start, stop)``; that slab is written into the local parameter along the same ``dim`` starting at
    ``local_start``. ``dim=None`` means the whole tensor maps 1:1 (renamed at most). A fused parameter
    (``qkv``, ``gate_up``) has several pieces, one per source; a tensor-parallel rank's piece covers only its
    range. Positions of the full tensor outside ``[start, stop)`` belong to another rank and are dropped.
    """

    source: str
    source_shape: tuple[int, ...]
    dim: int | None = None
    start: int = 0
    stop: int = 0
    local_start: int = 0


@dataclass(frozen=True)
class ParamSpec:
    """One local parameter of an engine: its local name, dtype, shape, device, and the trainer-side pieces
    it is made of (one piece for an ordinary or renamed parameter)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    device: str
    pieces: tuple[ParamPiece, ...]


def identity_specs(tensors: Mapping[str, torch.Tensor]) -> list[ParamSpec]:
    """One ParamSpec per tensor, mapping it 1:1 to the trainer tensor of the same name."""
    return [ParamSpec(name, t.dtype, tuple(t.shape), str(t.device), (ParamPiece(name, tuple(t.shape)),))
            for name, t in tensors.items()]


def check_spec(spec: ParamSpec) -> None:
    """ValueError unless ``spec``'s pieces tile its local shape exactly, each within its source."""
    shape = tuple(spec.shape)
    if not spec.pieces:
        raise ValueError(f"parameter {spec.name!r} has no pieces")
    whole = [p for p in spec.pieces if p.dim is None]
    if whole:
        p = whole[0]
        if len(spec.pieces) != 1:
            raise ValueError(f"parameter {spec.name!r}: a whole-tensor piece ({p.source!r}) must be its only piece")
        if tuple(p.source_shape) != shape:
            raise ValueError(f"parameter {spec.name!r} has shape {list(shape)} but maps 1:1 to {p.source!r} of "
                             f"shape {list(p.source_shape)}")
        return
    dims = {p.dim for p in spec.pieces}
    if len(dims) != 1:
        raise ValueError(f"parameter {spec.name!r}: pieces cut along different dims {sorted(dims)}")
    d = dims.pop()
    if not 0 <= d < len(shape):
        raise ValueError(f"parameter {spec.name!r}: piece dim {d} outside its {len(shape)} dims")
    covered = []
    for p in spec.pieces:
        src = tuple(p.source_shape)
        if len(src) != len(shape) or any(a != b for i, (a, b) in enumerate(zip(src, shape)) if i != d):
            raise ValueError(f"parameter {spec.name!r} {list(shape)}: piece from {p.source!r} {list(src)} differs "
                             f"outside dim {d}")
        if not 0 <= p.start < p.stop <= src[d]:
            raise ValueError(f"parameter {spec.name!r}: piece range [{p.start}, {p.stop}) of {p.source!r} is "
                             f"outside 0..{src[d]}")
        covered.append((p.local_start, p.local_start + p.stop - p.start, p.source))
    covered.sort()
    at = 0
    for lo, hi, src in covered:
        if lo != at:
            raise ValueError(f"parameter {spec.name!r}: along dim {d}, rows {at}..{lo} are covered by "
                             f"{'no piece' if lo > at else 'two pieces'} (at {src!r})")
        at = hi
    if at != shape[d]:
        raise ValueError(f"parameter {spec.name!r}: pieces cover {at} of {shape[d]} along dim {d}")


def map_positions(positions: torch.Tensor, piece: ParamPiece, local_shape: Sequence[int]):
    """Map flat positions of the full trainer tensor (int64, row-major ``piece.source_shape``) to flat
    positions of the local parameter. Returns ``(keep, local)``: a bool mask over ``positions`` (True where
    this piece owns the position) and the local flat positions of the kept ones, in the same order (so
    ascending positions stay ascending)."""
    if piece.dim is None:
        return torch.ones_like(positions, dtype=torch.bool), positions
    src = piece.source_shape
    d = piece.dim
    inner = math.prod(src[d + 1:])
    coord = torch.div(positions, inner, rounding_mode="floor") % src[d]
    keep = (coord >= piece.start) & (coord < piece.stop)
    p, c = positions[keep], coord[keep]
    outer = torch.div(p, inner * src[d], rounding_mode="floor")
    local = (outer * (local_shape[d] * inner) + (c - piece.start + piece.local_start) * inner + p % inner)
    return keep, local


def slab(full: torch.Tensor, piece: ParamPiece) -> torch.Tensor:
    """The part of the trainer's full tensor that ``piece`` takes (a view)."""
    return full if piece.dim is None else full.narrow(piece.dim, piece.start, piece.stop - piece.start)


def local_slab(local: torch.Tensor, piece: ParamPiece) -> torch.Tensor:
    """Where ``piece`` sits in the local tensor (a view)."""
    return local if piece.dim is None else local.narrow(piece.dim, piece.local_start, piece.stop - piece.start)


def check_like(t, dtype: torch.dtype, shape, what: str, wanted: str, error: type[Exception] = ValueError) -> None:
    """Raise ``error`` unless ``t`` (a tensor, or anything with a dtype and a shape) is ``dtype`` and ``shape``:
    "``what`` <its dtype and shape>, ``wanted`` <dtype and shape>"."""
    if t.dtype != dtype or tuple(t.shape) != tuple(shape):
        raise error(f"{what} {t.dtype}{list(t.shape)}, {wanted} {dtype}{list(shape)}")


def build_local(spec: ParamSpec, full: Mapping[str, torch.Tensor], *, device=None) -> torch.Tensor:
    """The local tensor ``spec`` describes, cut (and fused) from the trainer's full tensors ``full``.
    Raises KeyError naming a missing source and ValueError for a dtype or shape mismatch."""
    out = torch.empty(spec.shape, dtype=spec.dtype, device=device or "cpu")
    for p in spec.pieces:
        if p.source not in full:
            raise KeyError(f"trainer tensor {p.source!r} (needed by {spec.name!r}) is missing")
        t = full[p.source]
        check_like(t, spec.dtype, p.source_shape, f"trainer tensor {p.source!r} is", f"{spec.name!r} expects")
        local_slab(out, p).copy_(slab(t, p))
    return out


def expected_checksums(specs: Sequence[ParamSpec], full: Mapping[str, object]) -> dict[str, int]:
    """What each local parameter's ``checksum`` must be, from the trainer's side, by local name.

    ``full`` maps trainer names to full tensors or to their ``syncd.ops.checksum`` (ints, as in a manifest).
    A 1:1 parameter needs either; a sliced or fused one needs the full tensors of all its sources (it is built
    and checksummed). Parameters whose sources are missing, or given only as ints when tensors are needed,
    are left out of the result, so compare on the keys returned."""
    out: dict[str, int] = {}
    for spec in specs:
        if len(spec.pieces) == 1 and spec.pieces[0].dim is None:
            v = full.get(spec.pieces[0].source)
            if isinstance(v, int):
                out[spec.name] = v
            elif isinstance(v, torch.Tensor):
                out[spec.name] = _checksum(v)
            continue
        if all(isinstance(full.get(p.source), torch.Tensor) for p in spec.pieces):
            out[spec.name] = _checksum(build_local(spec, full))  # type: ignore[arg-type]
    return out


# -- word views of local tensors -------------------------------------------------------------------------------

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def word_view(flat: torch.Tensor) -> torch.Tensor:
    """A 1-D view of ``flat``'s elements as integers of the same width (bit-exact compares and copies)."""
    return flat.view(_INT_OF_WIDTH[flat.element_size()])


def flat_view(t: torch.Tensor, name: str) -> torch.Tensor:
    """``t`` as a 1-D view (no copy); ValueError naming local tensor ``name`` when it cannot be flattened so."""
    try:
        return t.detach().view(-1)
    except RuntimeError:
        raise ValueError(f"local tensor {name!r} cannot be flattened without a copy (strides "
                         f"{tuple(t.stride())} for shape {tuple(t.shape)}); pass a view that can") from None


def bf16_view_of_fp32(t: torch.Tensor) -> torch.Tensor:
    """The bf16 words of an fp32 tensor whose values are all bf16-exact (low 16 bits zero), as a bf16 view
    of the same shape sharing its memory: writing a bf16 word through it sets the fp32 value exactly.
    Little-endian hosts only (the bf16 word is the high half of each fp32 word)."""
    if t.dtype != torch.float32:
        raise ValueError(f"bf16_view_of_fp32 needs a float32 tensor, got {t.dtype}")
    if sys.byteorder != "little":  # pragma: no cover
        raise ValueError("bf16_view_of_fp32 needs a little-endian host")
    if not t.is_contiguous():
        raise ValueError("bf16_view_of_fp32 needs a contiguous tensor")
    return t.detach().view(torch.bfloat16)[..., 1::2] if t.dim() else t.detach().view(1).view(torch.bfloat16)[1]
