"""Kept sets: which token ids top-k/top-p sampling may draw from, computed once for the engine's sampler and the
trainer alike (:func:`kept_sets`), their 32-bit fingerprint (:func:`kept_fingerprint`), and rebuilding a recorded
set from the trainer's own logits (:func:`rebuild_kept`). The rules are specified one row at a time by
``syncd/ops/reference/replay.py`` (``kept_set_row``, ``kept_fingerprint``); here they run vectorised over rows.

Backends (the op ``kept_sets`` of :mod:`syncd.ops._dispatch`; :func:`rebuild_kept` ranks through it):
``reference`` is the per-row specification (its entry: ``syncd/ops/reference/backend.py``); ``cpu``, ``cuda`` and
``triton`` all run the one vectorised PyTorch implementation on the logits' device (torch's own kernels: ranking is
a ``topk``/``sort``, there is no kernel of ours to write), so ``auto`` takes it on every device. Pure functions;
thread-safe.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from syncd.ops._dispatch import kernel, kernel_of, resolve
from syncd.ops._replay_layout import FINGERPRINT_SALT, kept_rows

__all__ = ["KeptSets", "RebuiltKept", "kept_sets", "kept_fingerprint", "rebuild_kept", "REBUILD_OK",
           "REBUILD_OVERLAP", "REBUILD_FINGERPRINT"]

#: :attr:`RebuiltKept.status` codes: rebuilt and verified; the recorded extra ids overlap the rebuilt top (so the
#: set has another size); the fingerprint differs (another set)
REBUILD_OK, REBUILD_OVERLAP, REBUILD_FINGERPRINT = 0, 1, 2
_BLOCK = 1 << 24  # elements of a block of rows fully ranked ([rows, V] values and ids)
_TOPK_BLOCK = 1 << 26  # elements of a block of rows whose first ranks come from topk (temporaries [rows, width])
_WIDE = 128  # given sizes: longer sets are ranked apart


class KeptSets(NamedTuple):
    """CSR over ``T`` rows (``offsets`` int64 ``[T + 1]``), each row in rank order (descending scaled logit, ties
    by the lower id): ``ids`` int64 ``[K]``, ``values`` (scaled logits, float32), ``gaps`` (float32: the value minus
    the next rank's value, ``inf`` past the vocabulary), ``logprobs`` (float32, renormalised over the row's set)."""

    ids: torch.Tensor
    offsets: torch.Tensor
    values: torch.Tensor
    gaps: torch.Tensor
    logprobs: torch.Tensor


class RebuiltKept(NamedTuple):
    """Rebuilt sets: CSR ``ids`` (ascending per row) / ``offsets``; ``status`` int8 ``[R]`` (``REBUILD_*``);
    ``margin`` float32 ``[R]``: the rebuilding logits' own gap at the rebuilt top's boundary (scaled units)."""

    ids: torch.Tensor
    offsets: torch.Tensor
    status: torch.Tensor
    margin: torch.Tensor


def _per_row(x, T: int, dtype, what: str, device) -> torch.Tensor:
    t = torch.as_tensor(x, dtype=dtype, device=device)
    if t.dim() == 0:
        t = t.expand(T)
    if t.shape != (T,):
        raise ValueError(f"kept_sets: {what} must be a number or one per row ({T}), got shape {tuple(t.shape)}")
    return t


def _csr(block: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """The first ``n[r]`` entries of each row of ``block`` ``[B, W]``, row after row."""
    return block[torch.arange(block.shape[1], device=block.device)[None, :] < n[:, None]]


def _scaled(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return x.float() / t[:, None]


def _rank(x: torch.Tensor, t: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, ids)`` ``[B, width + 1]``: the first ``width + 1`` ranks of each row of ``x / t`` (scaled in
    float32; descending, ties by the lower id), padded with ``-inf`` (id 0) past the vocabulary."""
    B, V = x.shape
    w = min(width + 1, V)
    if w + 1 >= V:
        vals, ids = torch.sort(_scaled(x, t), dim=1, descending=True, stable=True)
        vals, ids = vals[:, :w], ids[:, :w]
    else:
        # candidates by the raw logits (scaling by t > 0 keeps their order, up to ties it may create), one more
        # than needed: where the last two tie after scaling, a tie may cross the edge, and the row is ranked fully
        _, ti = torch.topk(x, w + 1, dim=1, largest=True, sorted=False)
        ti = ti.sort(dim=1).values
        tv = _scaled(x.gather(1, ti), t)
        o = torch.sort(tv, dim=1, descending=True, stable=True).indices
        vals, ids = tv.gather(1, o), ti.gather(1, o)
        full = (vals[:, w] == vals[:, w - 1]).nonzero()[:, 0]
        vals, ids = vals[:, :w].contiguous(), ids[:, :w].contiguous()
        if full.numel():
            fv, fi = torch.sort(_scaled(x[full], t[full]), dim=1, descending=True, stable=True)
            vals[full], ids[full] = fv[:, :w], fi[:, :w]
    if w < width + 1:
        pad = width + 1 - w
        vals = torch.cat([vals, vals.new_full((B, pad), float("-inf"))], 1)
        ids = torch.cat([ids, ids.new_zeros((B, pad))], 1)
    return vals, ids


def _block(x: torch.Tensor, t: torch.Tensor, greedy, k, top_p, sizes) -> tuple[torch.Tensor, ...]:
    """Kept sets of the rows ``x`` scaled by ``t``: ``(n, ids, values, gaps, logprobs)`` blocks ``[B, nmax]``."""
    dev = x.device
    if sizes is not None:
        n = sizes
        vals, ids = _rank(x, t, int(n.max()))
    else:
        kmax = int(k.max())
        vals, ids = _rank(x, t, kmax)
        n = k
        if bool((top_p < 1).any()):
            head = vals[:, :kmax].contiguous()
            if bool((k != kmax).any()):
                head = head.masked_fill(torch.arange(kmax, device=dev)[None, :] >= k[:, None], float("-inf"))
            cum = torch.cumsum(torch.log_softmax(head, dim=1).exp(), dim=1)
            # smallest prefix whose mass reaches top_p (at least one token)
            cut = torch.searchsorted(cum, top_p[:, None].contiguous())[:, 0] + 1
            n = torch.where(top_p < 1, torch.minimum(cut.clamp(min=1), k), k)
        n = torch.where(greedy, torch.ones_like(n), n)
    nmax = int(n.max())
    gaps = vals[:, :nmax] - vals[:, 1:nmax + 1]
    vals, ids = vals[:, :nmax].contiguous(), ids[:, :nmax].contiguous()  # (softmax of a strided view is slow)
    head = vals
    if bool((n != nmax).any()):
        head = head.masked_fill(torch.arange(nmax, device=dev)[None, :] >= n[:, None], float("-inf"))
    return n, ids, vals, gaps, torch.log_softmax(head, dim=1)


def kept_sets(logits: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0, *, sizes=None,
              backend: str = "auto") -> KeptSets:
    """The kept set of every row of ``logits`` ``[T, V]`` (any float dtype; scaled in float32 as
    ``logits / temperature``): ``top_k`` (``0`` or ``>= V``: no limit), then the smallest prefix whose renormalised
    mass reaches ``top_p``; ``temperature == 0`` is greedy (the first maximum). ``temperature``, ``top_k`` and
    ``top_p`` are numbers or one per row. With ``sizes`` (int, one per row, ``1..V``) each row keeps its first
    ``sizes[t]`` ranks instead (``top_k``/``top_p`` unused): how a trainer rebuilds a recorded set.

    The engine's sampler and the trainer both call this, so they rank alike. Raises ``ValueError`` for malformed
    arguments, ``BackendUnavailable`` for a backend that cannot run (module docstring)."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.dtype.is_floating_point:
        raise ValueError("kept_sets takes logits as a [T, V] floating-point tensor")
    name = resolve("kept_sets", backend, logits.device.type)
    T, V = logits.shape
    dev = logits.device
    if T and T * V <= _BLOCK and sizes is None and name != "reference" and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in (temperature, top_k, top_p)):
        if not (math.isfinite(temperature) and temperature >= 0):
            raise ValueError("kept_sets: temperatures must be finite and >= 0")
        if not 0 < top_p <= 1:
            raise ValueError("kept_sets: top_p must be in (0, 1]")
        return _uniform(logits, float(temperature), int(top_k), float(top_p))  # a sampler's call, step by step
    temp = _per_row(temperature, T, torch.float32, "temperature", dev)
    if T and (bool((temp < 0).any()) or not bool(torch.isfinite(temp).all())):
        raise ValueError("kept_sets: temperatures must be finite and >= 0")
    k = _per_row(top_k, T, torch.int64, "top_k", dev)
    k = torch.where((k > 0) & (k < V), k, torch.full_like(k, V))
    p = _per_row(top_p, T, torch.float32, "top_p", dev)
    if T and not bool(((p > 0) & (p <= 1)).all()):
        raise ValueError("kept_sets: top_p must be in (0, 1]")
    if sizes is not None:
        sizes = _per_row(sizes, T, torch.int64, "sizes", dev)
        if T and (int(sizes.min()) < 1 or int(sizes.max()) > V):
            raise ValueError(f"kept_sets: sizes must be in 1..{V}")
    return KeptSets(*kernel_of("kept_sets", name)(logits, temp, k, p, sizes))


# ---------------------------------------------------------------------------------------------- kernels
# kept_sets(logits [T, V], temperature [T] (0: greedy), top_k [T] (1..V), top_p [T], sizes [T] or None) by backend:
# the fields of KeptSets, in order (the reference one, per row: syncd/ops/reference/backend.py)


@kernel("kept_sets", "cpu", "cuda", "triton")
def _sets_vectorised(logits, temp, k, p, sizes) -> KeptSets:
    T = logits.shape[0]
    dev = logits.device
    greedy = temp == 0
    if not T:
        z64, z32 = torch.zeros(0, dtype=torch.int64, device=dev), torch.zeros(0, dtype=torch.float32, device=dev)
        return KeptSets(z64, torch.zeros(1, dtype=torch.int64, device=dev), z32, z32, z32)
    if sizes is None:
        return _sets(logits, temp, greedy, k, p, None, _BLOCK)
    # given sizes (a trainer rebuilding): every row ranked to at most _WIDE ids in place, the few longer sets again
    # on their own (copying those rows only), so that one long set does not widen every block's topk
    wide = (sizes > _WIDE).nonzero()[:, 0]
    if not wide.numel() or wide.numel() == T:
        return _sets(logits, temp, greedy, k, p, sizes, _TOPK_BLOCK)
    offsets = torch.cat([sizes.new_zeros(1), sizes.cumsum(0)])
    K = int(offsets[-1])
    out = [torch.empty(K, dtype=torch.int64, device=dev)] + [torch.empty(K, device=dev) for _ in range(3)]
    narrow = (sizes <= _WIDE).nonzero()[:, 0]
    first = _sets(logits, temp, greedy, k, p, sizes.clamp(max=_WIDE), _TOPK_BLOCK)
    second = _sets(logits.index_select(0, wide), temp[wide], greedy[wide], k[wide], p[wide], sizes[wide], _TOPK_BLOCK)
    for rows, part, own in ((narrow, first, narrow), (wide, second, torch.arange(wide.numel(), device=dev))):
        n = part.offsets[own + 1] - part.offsets[own]
        within = torch.repeat_interleave(torch.arange(rows.numel(), device=dev), n)
        step = torch.arange(within.numel(), device=dev) - torch.cat([n.new_zeros(1), n.cumsum(0)])[within]
        src, dest = part.offsets[own][within] + step, offsets[rows][within] + step
        for o, v in zip(out, (part.ids, part.values, part.gaps, part.logprobs)):
            o[dest] = v[src]
    return KeptSets(out[0], offsets, *out[1:])


def _uniform(x: torch.Tensor, temperature: float, top_k: int, top_p: float) -> KeptSets:
    """:func:`kept_sets` of the rows ``x`` ``[T, V]`` (``T * V <= _BLOCK``: one block of :func:`_sets`) with the
    same scalar parameters, in fewer ops: a sampler calls it once per step on a few rows, where the general path's
    per-row parameters, checks and CSR cuts cost more than the ranking. The same operations on the same shapes as
    :func:`_block` and :func:`_sets`, so the same bits (``tests/ops/test_replay_sets.py`` compares them)."""
    T, V = x.shape
    dev = x.device
    greedy = temperature == 0
    k = 1 if greedy else top_k if 0 < top_k < V else V
    vals, ids = _rank(x, torch.full((T,), 1.0 if greedy else temperature, dtype=torch.float32, device=dev), k)
    p = torch.full((T, 1), top_p, dtype=torch.float32, device=dev)
    if not greedy and float(p[0, 0]) < 1.0:  # top_p as the general path holds it (float32: 1 - 1e-9 is 1)
        cum = torch.cumsum(torch.log_softmax(vals[:, :k].contiguous(), dim=1).exp(), dim=1)
        # smallest prefix whose mass reaches top_p (at least one token)
        cut = torch.searchsorted(cum, p)[:, 0] + 1
        n = cut.clamp_(min=1, max=k)
    else:
        n = torch.full((T,), k, dtype=torch.int64, device=dev)
    nmax = int(n.max())
    gaps = vals[:, :nmax] - vals[:, 1:nmax + 1]
    vals, ids = vals[:, :nmax].contiguous(), ids[:, :nmax].contiguous()
    drop = torch.arange(nmax, device=dev)[None, :] >= n[:, None]
    lp = torch.zeros_like(vals) if greedy else torch.log_softmax(vals.masked_fill(drop, float("-inf")), dim=1)
    kept = (~drop).view(-1).nonzero().view(-1)  # one nonzero for the four CSR cuts
    ids, vals, gaps, lp = (b.reshape(-1).index_select(0, kept) for b in (ids, vals, gaps, lp))
    return KeptSets(ids, torch.cat([n.new_zeros(1), n.cumsum(0)]), vals, gaps, lp)


def _sets(logits, temp, greedy, k, p, sizes, block: int) -> KeptSets:
    """:func:`kept_sets` of every row, in blocks of ``block // V`` rows."""
    T, V = logits.shape
    out = {k2: [] for k2 in ("n", "ids", "values", "gaps", "logprobs")}
    step = max(1, block // max(V, 1))
    for a in range(0, T, step):
        b = min(T, a + step)
        t = torch.where(greedy[a:b], torch.ones_like(temp[a:b]), temp[a:b])
        n, ids, vals, gaps, lp = _block(logits[a:b], t, greedy[a:b], k[a:b], p[a:b],
                                        None if sizes is None else sizes[a:b])
        lp = torch.where(greedy[a:b, None], torch.zeros_like(lp), lp)
        out["n"].append(n)
        for key, blk in (("ids", ids), ("values", vals), ("gaps", gaps), ("logprobs", lp)):
            out[key].append(_csr(blk, n))
    n = torch.cat(out["n"])
    return KeptSets(torch.cat(out["ids"]), torch.cat([n.new_zeros(1), n.cumsum(0)]), torch.cat(out["values"]),
                    torch.cat(out["gaps"]), torch.cat(out["logprobs"]))


# ------------------------------------------------------------------------------------------ fingerprints

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for int64 ``x`` in ``[0, 2**32)`` without overflowing int64."""
    return (x * (c & 0xFFFF) + ((x * (c >> 16)) & 0xFFFF) * 65536) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def kept_fingerprint(ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """int64 ``[T]`` in ``[0, 2**32)``: the 32-bit fingerprint of each CSR row of ``ids`` (any order within a row;
    ``syncd.ops.reference.replay.kept_fingerprint`` is the specification)."""
    ids = torch.as_tensor(ids).to(torch.int64)
    offsets = torch.as_tensor(offsets).to(torch.int64)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) > _M32):
        raise ValueError("kept_fingerprint: ids must be in [0, 2**32)")
    h = _mix32(ids ^ FINGERPRINT_SALT)
    rows = kept_rows(offsets)
    return torch.zeros(offsets.numel() - 1, dtype=torch.int64, device=ids.device).index_add_(0, rows, h) & _M32


# ------------------------------------------------------------------------------------------ rebuilding


def rebuild_kept(logits: torch.Tensor, top, extra_ids, extra_offsets, fingerprints, temperature=1.0, *,
                 backend: str = "auto") -> RebuiltKept:
    """Rebuild recorded kept sets from ``logits`` ``[R, V]`` (the rebuilding side's logits of the rows): row ``r``
    is the first ``top[r]`` ranks of its logits (:func:`kept_sets` with ``sizes``) together with the recorded
    ``extra_ids`` (CSR ``extra_offsets``; ids the recorder listed because their rank was not robust), verified
    against the recorded ``fingerprints`` (:func:`kept_fingerprint`). ``temperature`` (number or one per row) only
    scales :attr:`RebuiltKept.margin`. A row whose status is not ``REBUILD_OK`` is not the recorded set: the
    logits differ from the recorder's by more than it allowed (or are of other weights). Raises ``ValueError``
    for malformed arguments."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError("rebuild_kept takes logits as a [R, V] tensor")
    R, V = logits.shape
    dev = logits.device
    top = torch.as_tensor(top, dtype=torch.int64, device=dev).reshape(-1)
    extra_ids = torch.as_tensor(extra_ids, dtype=torch.int64, device=dev).reshape(-1)
    extra_offsets = torch.as_tensor(extra_offsets, dtype=torch.int64, device=dev).reshape(-1)
    fingerprints = torch.as_tensor(fingerprints, dtype=torch.int64, device=dev).reshape(-1)
    if top.numel() != R or fingerprints.numel() != R or extra_offsets.numel() != R + 1:
        raise ValueError(f"rebuild_kept: {R} rows need {R} tops and fingerprints and {R + 1} extra offsets")
    if int(extra_offsets[0]) != 0 or int(extra_offsets[-1]) != extra_ids.numel() or \
            bool((extra_offsets[1:] < extra_offsets[:-1]).any()):
        raise ValueError("rebuild_kept: extra offsets must rise from 0 to len(extra_ids)")
    if extra_ids.numel() and (int(extra_ids.min()) < 0 or int(extra_ids.max()) >= V):
        raise ValueError(f"rebuild_kept: extra ids outside 0..{V - 1}")
    if R and (int(top.min()) < 1 or int(top.max()) > V):
        raise ValueError(f"rebuild_kept: tops must be in 1..{V}")
    ks = kept_sets(logits, temperature, sizes=top, backend=backend)
    margin = ks.gaps[ks.offsets[1:] - 1] if R else torch.zeros(0, device=dev)
    rows = torch.cat([kept_rows(ks.offsets), kept_rows(extra_offsets)])
    key, _ = torch.sort(rows * V + torch.cat([ks.ids, extra_ids]))
    ids = key % V
    counts = top + (extra_offsets[1:] - extra_offsets[:-1])
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    status = torch.zeros(R, dtype=torch.int8, device=dev)
    fp = kept_fingerprint(ids, offsets)
    status[fp != fingerprints] = REBUILD_FINGERPRINT
    same = key[1:] == key[:-1]
    if bool(same.any()):
        status[key[1:][same] // V] = REBUILD_OVERLAP
    return RebuiltKept(ids, offsets, status, margin.float())
