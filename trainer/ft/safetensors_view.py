"""Tensors that view a verified safetensors file in memory, without copying it.

    tensors = view_safetensors(buf, where="replica of rank-1 step 7: model.safetensors")

``safetensors.torch.load(bytes)`` copies every tensor out of the file; a rebuilt rank's 1 GiB of state then costs a
second pass over memory (about a third of a rebuild here). :func:`view_safetensors` parses the header itself and
returns ``torch.frombuffer`` views into ``buf``: the tensors share ``buf``'s memory and keep it alive (ownership
passes to them; ``buf`` must be a writable buffer -- a ``bytearray`` -- that nobody else changes afterwards). A
tensor whose bytes are not aligned to its element size is copied instead (the layout the safetensors library
writes keeps them aligned; a foreign writer might not).

The file is hostile until checked, even after its hash matched (the manifest may be forged where no key is set):
the header length, the header JSON (:mod:`syncd.jsonsafe`: size, depth, no NaN), every entry's dtype, shape and
``data_offsets`` are checked against the file, the tensors must cover the data exactly once (no overlap, no gap,
no trailing bytes: what the library itself requires), and shape times element size must equal each tensor's
bytes. Anything else raises ``ValueError`` (the caller's ``error``) naming the file and the entry. Thread-safe (no
shared state).
"""

from __future__ import annotations

import math
import struct

import torch

from syncd import jsonsafe

__all__ = ["view_safetensors", "SAFETENSORS_DTYPES"]

SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
                      "F8_E5M2": torch.float8_e5m2, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64}
MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit
_MAX_DIMS = 64


def view_safetensors(buf, *, where: str, error: type[ValueError] = ValueError) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` viewing ``buf`` (a writable bytes-like object, e.g. ``bytearray``); see the module
    docstring. Raises ``error`` for anything malformed."""
    mv = memoryview(buf)
    if mv.readonly:
        raise TypeError(f"{where}: view_safetensors needs a writable buffer (a bytearray), got a read-only one")
    size = mv.nbytes
    if size < 8:
        raise error(f"{where}: {size} bytes, shorter than a safetensors header's length field")
    (hlen,) = struct.unpack_from("<Q", mv, 0)
    if hlen > min(MAX_HEADER_BYTES, size - 8):
        raise error(f"{where}: header of {hlen} bytes in a file of {size}")
    header = jsonsafe.loads(mv[8:8 + hlen], what=f"{where}: safetensors header", max_bytes=MAX_HEADER_BYTES,
                            max_depth=8, floats=False, unique_members=True, error=error)
    if not isinstance(header, dict):
        raise error(f"{where}: the safetensors header is not a JSON object")
    start, data = 8 + hlen, size - 8 - hlen
    entries = []
    for name, ent in header.items():
        if name == "__metadata__":
            if not isinstance(ent, dict) or not all(isinstance(v, str) for v in ent.values()):
                raise error(f"{where}: __metadata__ must map names to strings")
            continue
        entries.append((_entry(name, ent, data, where, error), name))
    entries.sort(key=lambda e: (e[0][0], e[0][1], e[1]))
    at = 0
    for (begin, end, _, _), name in entries:
        if begin != at:
            raise error(f"{where}: tensor {name!r} starts at byte {begin} of the data, expected {at} "
                        "(tensors overlap or leave a gap)")
        at = end
    if at != data:
        raise error(f"{where}: the tensors cover {at} of the {data} data bytes")
    out, base = {}, torch.frombuffer(mv, dtype=torch.uint8, count=1).data_ptr()  # a slice's start may be odd
    for (begin, end, dtype, shape), name in entries:
        item = torch.empty((), dtype=dtype).element_size()
        count = (end - begin) // item
        if count == 0:
            out[name] = torch.empty(shape, dtype=dtype)
        elif (base + start + begin) % item == 0:
            out[name] = torch.frombuffer(mv, dtype=dtype, count=count, offset=start + begin).view(shape)
        else:
            raw = torch.frombuffer(mv, dtype=torch.uint8, count=end - begin, offset=start + begin)
            out[name] = raw.clone().view(dtype).view(shape)
    return out


def _entry(name: str, ent, data: int, where: str, error) -> tuple[int, int, torch.dtype, list[int]]:
    if not isinstance(ent, dict) or set(ent) != {"dtype", "shape", "data_offsets"}:
        raise error(f"{where}: tensor {name!r}: an entry holds exactly dtype, shape and data_offsets")
    dtype = SAFETENSORS_DTYPES.get(ent["dtype"]) if isinstance(ent["dtype"], str) else None
    if dtype is None:
        raise error(f"{where}: tensor {name!r}: unknown dtype {str(ent['dtype'])[:20]!r}")
    shape, offs = ent["shape"], ent["data_offsets"]
    if (not isinstance(shape, list) or len(shape) > _MAX_DIMS
            or not all(type(d) is int and 0 <= d < 1 << 62 for d in shape)):
        raise error(f"{where}: tensor {name!r}: shape must be a list of at most {_MAX_DIMS} sizes >= 0")
    if (not isinstance(offs, list) or len(offs) != 2 or not all(type(o) is int for o in offs)
            or not 0 <= offs[0] <= offs[1] <= data):
        raise error(f"{where}: tensor {name!r}: data_offsets {str(offs)[:60]} outside the {data} data bytes")
    item = torch.empty((), dtype=dtype).element_size()
    if math.prod(shape) * item != offs[1] - offs[0]:
        raise error(f"{where}: tensor {name!r}: shape {shape} of {ent['dtype']} is {math.prod(shape) * item} "
                    f"bytes, data_offsets give {offs[1] - offs[0]}")
    return offs[0], offs[1], dtype, shape
