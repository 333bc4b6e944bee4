"""Reference points of the codec benchmark, computed over the same deltas: the order-0 entropy bound and the
public formats (zstd of the weights, of old XOR new, of int32 index + bf16 value, of gap varints + zigzag key
deltas) with their encode times."""

from __future__ import annotations

import math

import numpy as np
import torch
try:
    import zstandard
except ImportError as exc:  # pragma: no cover
    raise ImportError("the codec benchmark's baselines need zstandard (pip install 'syncd[bench]')") from exc

from bench._timing import Stopwatch
from syncd.ops import delta
from syncd.ops.reference import delta as ref_delta


def entropy_bits(counts: np.ndarray) -> float:
    p = counts[counts > 0] / counts.sum()
    return float(-(counts[counts > 0] * np.log2(p)).sum())


def h2(p: float) -> float:
    return 0.0 if p <= 0 or p >= 1 else -(p * math.log2(p) + (1 - p) * math.log2(1 - p))


def entropy_bound(old: dict, new: dict) -> dict:
    """Order-0 bound in bytes: per tensor, N*H(p) for positions plus the empirical entropy of its value
    changes (key deltas); also the same with one p and one value histogram for the whole model."""
    pos_bits = val_bits = 0.0
    n_total = c_total = 0
    all_vals = []
    for name in old:
        dt = delta.dtype_format(old[name].dtype)
        ob = ref_delta.bits_view(old[name].view(torch.int16).numpy(), dt)  # flattened
        nb = ref_delta.bits_view(new[name].view(torch.int16).numpy(), dt)
        _, v = ref_delta.changes(ob, nb, dt)
        n, c = ob.size, v.size
        n_total += n
        c_total += c
        pos_bits += n * h2(c / n)
        if c:
            _, counts = np.unique(v, return_counts=True)
            val_bits += entropy_bits(counts)
            all_vals.append(v)
    glob_pos = n_total * h2(c_total / n_total)
    glob_val = entropy_bits(np.unique(np.concatenate(all_vals), return_counts=True)[1]) if all_vals else 0.0
    return {"per_tensor_bytes": (pos_bits + val_bits) / 8, "positions_bytes": pos_bits / 8,
            "values_bytes": val_bits / 8, "global_bytes": (glob_pos + glob_val) / 8,
            "changed": c_total, "numel": n_total}


def _zstd(data: bytes, level: int = 3) -> bytes:
    return zstandard.ZstdCompressor(level=level).compress(data)


def _varint_bytes(x: np.ndarray) -> bytes:
    """LEB128 of non-negative ints, vectorised."""
    x = x.astype(np.uint64)
    out = []
    groups = np.maximum(1, (np.floor(np.log2(np.maximum(x, 1).astype(np.float64))) // 7 + 1).astype(np.int64))
    maxg = int(groups.max()) if x.size else 0
    cols = np.zeros((x.size, maxg), np.uint8)
    for k in range(maxg):
        part = ((x >> np.uint64(7 * k)) & np.uint64(0x7F)).astype(np.uint8)
        more = (groups > k + 1).astype(np.uint8) << 7
        cols[:, k] = part | more
    keep = np.arange(maxg)[None, :] < groups[:, None]
    out = cols[keep]
    return out.tobytes()


def baselines(old: dict, new: dict, repeats: int) -> dict:
    """Sizes and encode throughput of the public formats, over the same tensors."""
    sizes = {"zstd_full": 0, "zstd_xor": 0, "idx32_bf16_zstd": 0, "gapvarint_zigzag_zstd": 0}
    times = {k: 0.0 for k in sizes}
    for name in old:
        o = old[name].view(torch.int16).numpy().reshape(-1)
        n = new[name].view(torch.int16).numpy().reshape(-1)
        sw = Stopwatch()
        sizes["zstd_full"] += len(_zstd(n.tobytes()))
        laps = [sw.lap()]
        sizes["zstd_xor"] += len(_zstd((o ^ n).tobytes()))
        laps.append(sw.lap())
        idx = np.flatnonzero(o != n)
        sizes["idx32_bf16_zstd"] += len(_zstd(idx.astype(np.int32).tobytes() + n[idx].tobytes()))
        laps.append(sw.lap())
        dt = delta.dtype_format(torch.bfloat16)
        pos, v = ref_delta.changes(o.view(np.uint16), n.view(np.uint16), dt)
        gaps = np.diff(pos, prepend=-1) - 1
        sizes["gapvarint_zigzag_zstd"] += len(_zstd(_varint_bytes(gaps)) + _zstd(_varint_bytes(v)))
        laps.append(sw.lap())
        for k, dtm in zip(sizes, laps):
            times[k] += dtm
    return {"sizes": sizes, "encode_s": times}
