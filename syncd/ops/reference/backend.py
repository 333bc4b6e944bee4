"""The reference backend: every op's ``backend="reference"`` entry in the dispatch table
(``syncd/ops/_dispatch.py``), the specification's functions (this package) behind each op's calling convention.
The dispatch table imports this module when it is itself imported; it is the only way the ops reach the
specification, so that the specification stays one: what production code calls is what the tests hold every other
backend to.

Correct and slow; ``auto`` picks these only where no other backend can run (on a CPU without the native module,
and for the ops that have no native kernel). Each entry's contract is its op's, stated where the op registers its
other kernels; thread-safe as those are.
"""

from __future__ import annotations

import numpy as np
import torch

from syncd.ops._dispatch import kernel, register
from syncd.ops._replay_layout import kept_rows
from syncd.ops._tensors import byte_view
from syncd.ops.reference import checksum, context, delta, nvfp4, replay, scatter

# ---------------------------------------------------------------------------------------------- checksum


@kernel("checksum", "reference")
def _checksum(tensor: torch.Tensor) -> int:
    return checksum.checksum_bytes(byte_view(tensor.cpu()))


register("checksum_bytes", "reference", checksum.checksum_bytes)
register("scatter_words", "reference", scatter.scatter_words)

# ---------------------------------------------------------------------------------------------- delta codec


@kernel("encode", "reference")
def _encode(old, new, dt, shape, block_log2, version) -> bytes:
    return delta.encode(byte_view(old.cpu()), byte_view(new.cpu()), dt, shape, block_log2, version)


@kernel("find_changes", "reference")
def _find_changes(old, new, dt):
    pos, v = delta.changes(delta.bits_view(byte_view(old.cpu()), dt), delta.bits_view(byte_view(new.cpu()), dt), dt)
    return torch.from_numpy(pos).to(old.device), torch.from_numpy(v.view(np.int64)).to(old.device)


@kernel("apply", "reference")
def _apply(tensor, blob, dt, shape, verify) -> None:
    if tensor.device.type != "cpu":
        tmp = tensor.cpu()
        delta.decode_into(byte_view(tmp), blob, dt, shape, verify)
        with torch.no_grad():
            tensor.copy_(tmp)
        return
    delta.decode_into(byte_view(tensor), blob, dt, shape, verify)


@kernel("pack_changes", "reference")
def _pack_changes(dt, shape, block_log2, pos, v, base_ck, new_ck, version, classes) -> bytes:
    ctx_of = None
    if classes is not None:  # (class nibbles of the whole old tensor, e_top per block)
        nibbles, e_tops = classes
        cls = context.unpack_nibbles(nibbles, int(np.prod(shape, dtype=np.int64)))
        ctx_of = lambda b, lo, hi: (e_tops[b], cls[lo:hi])  # noqa: E731
    return delta.pack(dt, shape, block_log2, pos.astype(np.int64), v, base_ck, new_ck, version, ctx_of)


@kernel("unpack_changes", "reference")
def _unpack_changes(blob, dt, shape, host, nibbles):
    classes_of = None
    if host is not None:
        bits = delta.bits_view(byte_view(host), dt)
        classes_of = lambda b, lo, hi, e_top: context.classes_of(bits[lo:hi], dt, e_top)  # noqa: E731
    elif nibbles is not None:
        all_cls = context.unpack_nibbles(nibbles, int(np.prod(shape, dtype=np.int64)))
        classes_of = lambda b, lo, hi, e_top: all_cls[lo:hi]  # noqa: E731
    h, pos, v = delta.unpack(blob, classes_of)
    return pos.view(np.uint64), v, h.base_checksum, h.new_checksum


register("changed_words", "reference", delta.changed_words)

# ---------------------------------------------------------------------------------------------- nvfp4


@kernel("nvfp4_scale", "reference")
def _nvfp4_scale(x: torch.Tensor) -> torch.Tensor:
    return nvfp4.per_tensor_scale(x.cpu()).to(x.device)


@kernel("nvfp4_quantize", "reference")
def _nvfp4_quantize(x: torch.Tensor, pts: torch.Tensor):
    nvfp4.check_finite(x)
    qdata, scales = nvfp4.quantize(x, pts)
    return qdata.to(x.device), scales.to(x.device)


@kernel("nvfp4_dequantize", "reference")
def _nvfp4_dequantize(q, dtype: torch.dtype, out: torch.Tensor | None) -> torch.Tensor:
    values = nvfp4.dequantize(q.qdata, q.scales, q.per_tensor_scale, dtype).to(q.device)
    return values if out is None else out.copy_(values)


# ---------------------------------------------------------------------------------------------- replay


def _kept_forward(logits, ids, offsets, targets, temperature):
    with torch.no_grad():
        out, lse, zk = replay.kept_logprobs(logits, ids, offsets, targets, temperature)
        rows = kept_rows(offsets)
        found = torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device).index_add_(
            0, rows, (ids == targets[rows]).to(torch.int64))
    missing = found == 0  # the first row whose target is not in its kept set, or -1
    return out, lse, zk, int(torch.nonzero(missing)[0]) if bool(missing.any()) else -1


register("kept_logprobs", "reference", (_kept_forward, replay.kept_logprobs_backward))
register("pack_routes", "reference", replay.pack_routes)
register("unpack_routes", "reference", replay.unpack_routes)
register("gather_routed", "reference", (replay.gather_routed, replay.gather_routed_backward))


@kernel("kept_sets", "reference")
def _kept_sets(logits, temp, k, p, sizes):
    rows = [replay.kept_set_row(logits[t], float(temp[t]), int(k[t]), float(p[t]), None if sizes is None else
                                int(sizes[t])) for t in range(logits.shape[0])]
    parts = [torch.cat([r[i] for r in rows]) if rows else torch.zeros(0, dtype=torch.int64 if i == 0 else
                                                                       torch.float32) for i in range(4)]
    n = torch.tensor([r[0].numel() for r in rows], dtype=torch.int64)
    return parts[0], torch.cat([n.new_zeros(1), n.cumsum(0)]), *parts[1:]
