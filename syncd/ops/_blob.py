"""The host half of the delta codec (``docs/delta-format.md``): a blob's header, entropy-coding a change list
found elsewhere into a blob (``pack``) and decoding a blob back into one (``unpack``), and the facts of its
context blocks. ``delta``'s encoders and decoders on every device end here; the work runs natively when the
native module is built, else on the ``reference`` entries of the ops ``pack_changes`` / ``unpack_changes``
(``syncd/ops/_dispatch.py``), which write and read the same bytes.

Blobs are hostile input: everything here raises ``DeltaError`` saying what is wrong. Thread-safe (no state).
"""

from __future__ import annotations

import numpy as np
import torch

from syncd.errors import DeltaError
from syncd.ops import _backend, _context
from syncd.ops import _format as fmt
from syncd.ops._checksum import checksum_bytes
from syncd.ops._dispatch import dispatch, kernel
from syncd.ops._sections import read_e_top
from syncd.ops._tensors import raw_ptr

__all__ = ["native_call", "header", "check_base", "plain", "pack", "unpack", "block_e_tops", "context_e_tops"]


def native_call(fn, *args):
    """Run a native entry point, turning its ValueErrors into DeltaError (same message)."""
    try:
        return fn(*args)
    except DeltaError:
        raise
    except ValueError as e:
        raise DeltaError(str(e)) from None


def header(blob) -> fmt.Header:
    """The parsed and validated header of ``blob`` (its checksum included; payloads are not read)."""
    return fmt.parse_header(blob, checksum_bytes)


def check_base(base: torch.Tensor, dtype: torch.dtype, shape) -> None:
    """Raise ``DeltaError`` unless ``base`` is a ``dtype`` tensor of ``shape``."""
    if base.dtype != dtype or tuple(base.shape) != tuple(shape):
        blob = str(dtype).removeprefix("torch.")
        raise DeltaError(f"base is {base.dtype}{list(base.shape)}, the blob is for {blob}{list(shape)}")


def plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when ``raw_ptr`` can read it, else a contiguous copy of its values."""
    return t if raw_ptr(t) is not None else t.detach().resolve_conj().resolve_neg().contiguous()


def pack(dt: fmt.DType, shape, block_log2: int, pos: np.ndarray, v: np.ndarray, base_ck: int, new_ck: int,
         version: int, context) -> bytes:
    """Entropy-code changes found elsewhere (``pos``, ``v``: uint64, ascending positions) into a blob;
    ``context`` (format 2): (class nibbles of the whole old tensor, e_top per block), else None."""
    return dispatch("pack_changes", "auto", "cpu")(dt, shape, block_log2, pos, v, base_ck, new_ck, version, context)


@kernel("pack_changes", "cpu")
def _pack_cpu(dt, shape, block_log2, pos, v, base_ck, new_ck, version, context) -> bytes:
    nib, e_tops = context if context is not None else (None, [])
    return native_call(_backend.native().pack, dt.code, shape, block_log2, pos, v, base_ck, new_ck,
                       _backend.threads(), version, nib, e_tops)


def unpack(blob, h: fmt.Header, dt: fmt.DType, shape, base: torch.Tensor | None = None,
           e_tops: list[int] | None = None,
           nibbles: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Positions (uint64), values and checksums of a blob (``h``: its parsed header) for a target of
    ``dt``/``shape``. ``base`` (any device) is the tensor the blob applies to; format 2's context blocks cannot be
    decoded without it or ``nibbles``, its classes (:func:`base_nibbles`; ``base`` is then not read).
    ``e_tops``: the blob's :func:`block_e_tops` if the caller has them."""
    fmt.check_target(h, dt, shape)
    host = None
    if nibbles is None and base is not None and h.version == 2:
        if base.device.type == "cpu":
            check_base(base, getattr(torch, h.dtype.name), h.shape)
            host = plain(base)
        else:
            nibbles = base_nibbles(blob, h, base, e_tops).cpu().numpy()
    return dispatch("unpack_changes", "auto", "cpu")(blob, dt, shape, host, nibbles)


def base_nibbles(blob, h: fmt.Header, base: torch.Tensor, e_tops: list[int] | None = None) -> torch.Tensor:
    """The classes of ``base``'s elements for ``blob``'s context blocks, on ``base``'s device: uint8, two per byte
    (``_context.class_nibbles`` with the blob's e_top per block). ``DeltaError`` for a base of another dtype or
    shape."""
    check_base(base, getattr(torch, h.dtype.name), h.shape)
    tops = torch.tensor([max(0, e) for e in (e_tops or block_e_tops(blob))], dtype=torch.int64)
    return _context.class_nibbles(base.detach().contiguous(), h.dtype, h.block_log2, tops)[0]


@kernel("unpack_changes", "cpu")
def _unpack_cpu(blob, dt, shape, host, nibbles):
    """``host``: the base as a plain CPU tensor, or None; ``nibbles``: its classes (a GPU base's), or None."""
    return native_call(_backend.native().unpack, blob, dt.code, shape, _backend.threads(),
                       host.data_ptr() if host is not None else 0, nibbles)


def context_e_tops(blob, h: fmt.Header) -> list[int] | None:
    """The blob's :func:`block_e_tops` if it has a context block (format 2), else None."""
    if h.version != 2:
        return None
    e_tops = block_e_tops(blob)
    return e_tops if any(e >= 0 for e in e_tops) else None


def block_e_tops(blob) -> list[int]:
    """Each block's e_top (format 2 context blocks), -1 for the others."""
    if _backend.available("cpu", "cpu") is None:
        return list(native_call(_backend.native().block_e_tops, blob))
    h = header(blob)
    out, off, data = [], h.header_bytes, bytes(blob)
    for plen, _, _ in h.blocks:
        e = read_e_top(data[off : off + plen]) if h.version == 2 else None
        out.append(-1 if e is None else e)
        off += plen
    return out
