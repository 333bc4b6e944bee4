"""NVFP4 benchmark: quantize / dequantize throughput per backend, and the size of NVFP4 weight updates.

Throughput: a weight-like bf16 matrix is quantized and dequantized by every CPU backend (``cpu`` native,
``reference`` plain PyTorch) and, in the same process over the same bytes, by torchao's CPU quantizer
(``nvfp4_quantize`` / ``NVFP4Tensor.dequantize``, when torchao is installed), next to a NumPy read pass over
the bf16 bytes (the memory-speed yardstick; the native backend's ratios to it are medians over back-to-back
pairs of runs, steadier on a shared machine). Figures are GB/s of bf16 (bytes in for quantize, bytes out
for dequantize), medians of ``--repeats`` (at most 3 for the slow reference and torchao); ``quantize``
computes the per-tensor scale (two passes), ``quantize(pts)`` is given it (one pass, what torchao is timed on); ``dequantize`` allocates its output (as
torchao does: fresh pages cost about as much as the kernel here), ``deq(out=)`` writes into a reused one (as
an engine writing its parameters does). The native output is checked bit for bit
against the reference. GPU backends are timed by ``bench/gpu_nvfp4.py`` (in ``bench/gpu_check.sh``).

Delta sizes: real AdamW steps of a Qwen2-style model on a policy-gradient loss (``bench.codec``), the linear
weights exported to NVFP4 (``syncd.ops.nvfp4.quantize_state_dict``) K steps apart and encoded with
``syncd.ops.delta``: bytes as % of the packed NVFP4 bytes (codes + scales + per-tensor scales), with the
fraction of changed codes and scales, and the bf16 delta of the same weights for comparison. Writes JSON
(``--json``); the bit-for-bit check of every backend is the shared refcheck column (exit status 1 when it fails).

    python -m bench.nvfp4                  # 32 Mi-element matrix; ~110M-parameter model, lr 1e-6/1e-5, K=1,4
    python -m bench.nvfp4 --preset tiny    # seconds; what the test runs
"""

from __future__ import annotations

import argparse
import logging
import platform
import sys
import warnings

import numpy as np
import torch

from bench._report import Row, finish, output_flags
from bench._timing import Stopwatch
from bench import _timing
from syncd.ops import delta, native_features, nvfp4, threads
from syncd.ops.reference import nvfp4 as ref

log = logging.getLogger("bench.nvfp4")

PRESETS = {
    "default": dict(rows=8192, cols=4096, repeats=5, model="default", lrs="1e-6,1e-5", ks="1,4"),
    "tiny": dict(rows=64, cols=256, repeats=2, model="tiny", lrs="1e-5", ks="1,2"),
}


def read_pass(x: torch.Tensor):
    """The yardstick: a NumPy pass reading every byte of ``x`` (a sum over its 64-bit words)."""
    a = x.reshape(-1).view(torch.int16).numpy()
    a = a.view(np.uint64) if a.nbytes % 8 == 0 else a
    return lambda: a.sum()


def _torchao():
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            logging.disable(logging.WARNING)
            from torchao.prototype.mx_formats import nvfp4_tensor
        return nvfp4_tensor
    except ImportError:
        return None
    finally:
        logging.disable(logging.NOTSET)


class _Threads:
    """torch's intra-op pool at ``n`` threads inside the block (idle OpenMP workers spin on the cores the
    native kernels are timed on; see bench.codec)."""

    def __init__(self, n: int):
        self.n, self.before = n, torch.get_num_threads()

    def __enter__(self):
        torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        torch.set_num_threads(self.before)


def throughput(rows: int, cols: int, repeats: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, cols, generator=g) * 0.02).to(torch.bfloat16)
    nbytes = x.numel() * 2
    gbps = lambda s: nbytes / s / 1e9  # noqa: E731
    read = read_pass(x)
    with _Threads(1):
        read_s = _timing.median_time(read, repeats, warmup=1)
    want = nvfp4.quantize(x, backend="reference")
    pts = want.per_tensor_scale
    buf = torch.empty(x.shape, dtype=torch.bfloat16)
    ops = {"quantize": lambda name: nvfp4.quantize(x, backend=name),
           "quantize_pts": lambda name: nvfp4.quantize(x, per_tensor_scale=pts, backend=name),
           "dequantize": lambda name: nvfp4.dequantize(want, torch.bfloat16, backend=name),
           "dequantize_out": lambda name: nvfp4.dequantize(want, torch.bfloat16, out=buf, backend=name)}
    out = {"bytes_bf16": nbytes, "shape": [rows, cols], "read_gbps": gbps(read_s), "backends": {}}
    slow = min(repeats, 3)  # the reference and torchao run at tens of MB/s: timed alone, against read_s
    for name in ("cpu", "reference"):
        r = out["backends"][name] = {}
        for op, fn in ops.items():
            if name == "cpu":
                with _Threads(1):
                    t, ratio = _timing.paired(lambda: fn(name), read, repeats)
            else:
                t = _timing.median_time(lambda: fn(name), slow, warmup=1)
                ratio = read_s / t
            r[f"{op}_gbps"], r[f"{op}_vs_read"] = gbps(t), ratio
        got = nvfp4.quantize(x, backend=name)
        r["bit_exact"] = (torch.equal(got.qdata, want.qdata)
                          and torch.equal(got.scales.view(torch.uint8), want.scales.view(torch.uint8))
                          and torch.equal(nvfp4.dequantize(want, torch.bfloat16, backend=name).view(torch.int16),
                                          nvfp4.dequantize(want, torch.bfloat16, backend="reference").view(torch.int16)))
    ao = _torchao()
    if ao is not None:
        ao_q_s = _timing.median_time(lambda: ao.nvfp4_quantize(x, per_tensor_scale=pts), slow, warmup=1)
        t = ao.NVFP4Tensor(want.qdata, want.scales, 16, torch.bfloat16, per_tensor_scale=pts)
        ao_d_s = _timing.median_time(lambda: t.dequantize(torch.bfloat16), slow, warmup=1)
        out["torchao"] = {"quantize_pts_gbps": gbps(ao_q_s), "dequantize_gbps": gbps(ao_d_s),
                          "quantize_pts_vs_read": read_s / ao_q_s, "dequantize_vs_read": read_s / ao_d_s}
        for r in out["backends"].values():
            r["quantize_pts_vs_torchao"] = r["quantize_pts_gbps"] / out["torchao"]["quantize_pts_gbps"]
            r["dequantize_vs_torchao"] = r["dequantize_gbps"] / out["torchao"]["dequantize_gbps"]
    return out


def _changed(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements whose bits differ."""
    w = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return int((a.contiguous().view(w) != b.contiguous().view(w)).sum())


def _parts_bytes(state: dict, names: list[str]) -> int:
    return sum(state[n + s].numel() * state[n + s].element_size() for n in names for s in nvfp4.SUFFIXES)


def delta_sizes(cfg: dict, lrs: list[float], ks: list[int], seed: int) -> list[dict]:
    from bench.codec import snapshots

    rows = []
    for lr in lrs:
        t0 = Stopwatch()
        snaps = snapshots(cfg, lr, max(ks), seed)
        steps_s = t0.elapsed
        names = [n for n, t in snaps[0].items() if nvfp4.is_linear_weight(n, t)]
        base = nvfp4.quantize_state_dict(snaps[0], names)
        packed = _parts_bytes(base, names)
        bf16_bytes = sum(snaps[0][n].numel() * 2 for n in names)
        for k in ks:
            new = nvfp4.quantize_state_dict(snaps[k], names)
            keys = [n + s for n in names for s in nvfp4.SUFFIXES]
            blobs = delta.encode_many([base[n] for n in keys], [new[n] for n in keys], backend="cpu")
            for key, blob in zip(keys, blobs):  # lossless, as shipped
                if not torch.equal(delta.decode(base[key], blob, backend="cpu").reshape(-1).view(torch.uint8),
                                   new[key].reshape(-1).view(torch.uint8)):
                    raise AssertionError(f"NVFP4 delta round trip failed for {key}")
            size = sum(len(b) for b in blobs)
            codes_changed = sum(_changed(ref.unpack_codes(base[n + nvfp4.QDATA]), ref.unpack_codes(new[n + nvfp4.QDATA]))
                                for n in names)
            scales_changed = sum(_changed(base[n + nvfp4.SCALES], new[n + nvfp4.SCALES]) for n in names)
            pts_changed = sum(int(base[n + nvfp4.PER_TENSOR_SCALE] != new[n + nvfp4.PER_TENSOR_SCALE]) for n in names)
            n_codes = sum(base[n + nvfp4.QDATA].numel() * 2 for n in names)
            olds, news = [snaps[0][n] for n in names], [snaps[k][n] for n in names]
            bf16_blob = sum(len(b) for b in delta.encode_many(olds, news, backend="cpu"))
            bf16_changed = sum(_changed(a, b) for a, b in zip(olds, news))
            rows.append({"lr": lr, "k": k, "tensors": len(names), "params": n_codes, "packed_bytes": packed,
                         "delta_bytes": size, "delta_pct_of_packed": 100 * size / packed,
                         "codes_changed_pct": 100 * codes_changed / n_codes,
                         "scales_changed_pct": 100 * scales_changed / (n_codes // 16),
                         "per_tensor_scales_changed": pts_changed, "bf16_bytes": bf16_bytes,
                         "bf16_delta_pct": 100 * bf16_blob / bf16_bytes,
                         "bf16_changed_pct": 100 * bf16_changed / n_codes, "steps_s": steps_s})
    return rows


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.nvfp4", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="default")
    p.add_argument("--rows", type=int, help="rows of the timed bf16 matrix")
    p.add_argument("--cols", type=int, help="columns (a multiple of 16)")
    p.add_argument("--repeats", type=int, help="timing repeats (the median is reported)")
    p.add_argument("--lrs", help="comma-separated learning rates for the delta sizes")
    p.add_argument("--ks", help="comma-separated step distances for the delta sizes")
    p.add_argument("--seed", type=int, default=0)
    output_flags(p, "nvfp4")
    return p


def rows(tp: dict) -> list[Row]:
    """The shared columns: every backend's quantize and dequantize against the NumPy read pass of the same bf16
    bytes, refcheck: bit for bit against the reference backend; torchao's CPU quantizer where installed."""
    nbytes = tp["bytes_bf16"]
    sizes = f"{tp['shape'][0]}x{tp['shape'][1]} bf16"
    out = []
    for name, r in tp["backends"].items():
        for op in ("quantize", "quantize_pts", "dequantize", "dequantize_out"):
            out.append(Row(f"{name} {op}", nbytes / (r[f"{op}_gbps"] * 1e9), r[f"{op}_vs_read"], "NumPy read pass",
                           sizes, refcheck=r["bit_exact"]))
    for op in ("quantize_pts", "dequantize") if "torchao" in tp else ():
        ao = tp["torchao"]
        out.append(Row(f"torchao {op}", nbytes / (ao[f"{op}_gbps"] * 1e9), ao[f"{op}_vs_read"], "NumPy read pass",
                       sizes))
    return out


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = dict(PRESETS[args.preset])
    for key in ("rows", "cols", "repeats", "lrs", "ks"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    print(f"syncd NVFP4 benchmark: preset {args.preset}, threads {threads()}, "
          f"native SIMD {native_features()['nvfp4_simd']}, {platform.processor() or platform.machine()}")
    tp = throughput(cfg["rows"], cfg["cols"], cfg["repeats"], args.seed)
    print(f"\nthroughput on a {cfg['rows']}x{cfg['cols']} bf16 matrix ({tp['bytes_bf16'] / 2**20:.0f} MiB), "
          f"GB/s of bf16; NumPy read pass {tp['read_gbps']:.2f} GB/s")
    print(f"{'backend':>10} {'quantize':>9} {'/read':>6} {'quantize(pts)':>13} {'/read':>6} {'/torchao':>8} "
          f"{'dequantize':>10} {'/read':>6} {'/torchao':>8} {'deq(out=)':>9} {'/read':>6}  bit-exact")
    ao = tp.get("torchao")
    for name, r in tp["backends"].items():
        qa = f"{r['quantize_pts_vs_torchao']:8.2f}" if ao else f"{'n/a':>8}"
        da = f"{r['dequantize_vs_torchao']:8.2f}" if ao else f"{'n/a':>8}"
        print(f"{name:>10} {r['quantize_gbps']:9.2f} {r['quantize_vs_read']:6.2f} {r['quantize_pts_gbps']:13.2f} "
              f"{r['quantize_pts_vs_read']:6.2f} {qa} {r['dequantize_gbps']:10.2f} {r['dequantize_vs_read']:6.2f} {da} "
              f"{r['dequantize_out_gbps']:9.2f} {r['dequantize_out_vs_read']:6.2f}  {r['bit_exact']}")
    if ao:
        print(f"{'torchao':>10} {'':>9} {'':>6} {ao['quantize_pts_gbps']:13.2f} {ao['quantize_pts_vs_read']:6.2f} "
              f"{1.0:8.2f} {ao['dequantize_gbps']:10.2f} {ao['dequantize_vs_read']:6.2f} {1.0:8.2f}")
    else:
        print("torchao is not installed: no torchao baseline")
    from bench.codec import PRESETS as MODEL_PRESETS

    model = dict(MODEL_PRESETS[cfg["model"]])
    lrs = [float(v) for v in str(cfg["lrs"]).split(",")]
    ks = sorted(int(v) for v in str(cfg["ks"]).split(","))
    deltas = delta_sizes(model, lrs, ks, args.seed)
    r0 = deltas[0]
    print(f"\nNVFP4 updates from real AdamW steps ({r0['tensors']} linear weights, {r0['params'] / 1e6:.1f}M "
          f"parameters, {r0['packed_bytes'] / 2**20:.1f} MiB packed): delta as % of the packed NVFP4 bytes")
    print(f"{'lr':>7} {'K':>2} {'delta%':>8} {'codes chg%':>10} {'scales chg%':>11} {'pts chg':>7} | "
          f"{'bf16 delta%':>11} {'bf16 chg%':>9}")
    for r in deltas:
        print(f"{r['lr']:7.0e} {r['k']:2d} {r['delta_pct_of_packed']:7.3f}% {r['codes_changed_pct']:9.3f}% "
              f"{r['scales_changed_pct']:10.3f}% {r['per_tensor_scales_changed']:4d}/{r['tensors']:<3d}| "
              f"{r['bf16_delta_pct']:10.3f}% {r['bf16_changed_pct']:8.3f}%")
    cpu = tp["backends"]["cpu"]
    print(f"\nnative CPU quantize: {cpu['quantize_vs_read']:.2f}x the read pass (target >= 0.25), "
          f"{cpu['quantize_pts_vs_read']:.2f}x with the per-tensor scale given")
    out = {"bench": "nvfp4", "preset": args.preset, "config": cfg, "threads": threads(),
           "native_simd": native_features()["nvfp4_simd"], "python": sys.version.split()[0],
           "torch": torch.__version__, "throughput": tp, "deltas": deltas}
    return finish("nvfp4", args, out, rows(tp))


if __name__ == "__main__":
    sys.exit(main())
