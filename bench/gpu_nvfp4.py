"""NVFP4 quantize / dequantize on the GPU backends (CUDA C++ and Triton), timed on the device next to a
device-to-device copy of the same bytes (the HBM yardstick) in the same run, with a bit-for-bit check of every
backend's output against the native CPU backend (on every run: the refcheck column). Figures are GB/s of bf16 (read
by quantize, written by dequantize). Writes JSON (``--json``).

    python -m bench.gpu_nvfp4 --gib 1
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench._report import Row, finish, output_flags
from bench._timing import cuda_time, device_copy, have_cuda
from syncd.ops import available, nvfp4


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_nvfp4", description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0, help="bf16 tensor size in GiB")
    p.add_argument("--cols", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=10)
    output_flags(p, "gpu_nvfp4")
    return p


def time_backend(name: str, x, want, want_deq, repeats: int, copy_gbps: float) -> dict:
    """Quantize (per-tensor scale computed, then given) and dequantize on backend ``name`` in GB/s of bf16, their
    share of the copy's traffic rate, and whether codes, scales and the dequantized words equal the CPU's."""
    nbytes = x.numel() * 2
    pts = want.per_tensor_scale.cuda()
    q_s = cuda_time(lambda: nvfp4.quantize(x, backend=name), repeats)
    qp_s = cuda_time(lambda: nvfp4.quantize(x, per_tensor_scale=pts, backend=name), repeats)
    q = nvfp4.quantize(x, backend=name)
    out = torch.empty_like(x)
    d_s = cuda_time(lambda: nvfp4.dequantize(q, torch.bfloat16, out=out, backend=name), repeats)
    ok = (torch.equal(q.qdata.cpu(), want.qdata) and torch.equal(q.scales.cpu().view(torch.uint8),
                                                                   want.scales.view(torch.uint8))
          and torch.equal(q.per_tensor_scale.cpu(), want.per_tensor_scale)
          and torch.equal(out.cpu().view(torch.int16), want_deq.view(torch.int16)))
    r = {"quantize_gbps": nbytes / q_s / 1e9, "quantize_pts_gbps": nbytes / qp_s / 1e9,
         "dequantize_gbps": nbytes / d_s / 1e9, "refcheck": ok}
    # traffic: quantize reads 2 B and writes 0.5625 B per element; dequantize the reverse
    r["quantize_pts_pct_of_copy"] = 100 * (nbytes * 2.5625 / 2 / qp_s / 1e9) / copy_gbps
    r["dequantize_pct_of_copy"] = 100 * (nbytes * 2.5625 / 2 / d_s / 1e9) / copy_gbps
    print(f"{name:6s} quantize {r['quantize_gbps']:7.0f} GB/s (pts computed, incl. the amax pass and the NaN "
          f"check sync)  quantize(pts) {r['quantize_pts_gbps']:7.0f} GB/s ({r['quantize_pts_pct_of_copy']:.0f}% "
          f"of copy traffic)  dequantize {r['dequantize_gbps']:7.0f} GB/s ({r['dequantize_pct_of_copy']:.0f}%)  "
          f"refcheck {ok}")
    return r


def rows(results: dict) -> list[Row]:
    """The shared columns: every backend's quantize and dequantize against a device copy of the same bf16 bytes
    (ratio: copy seconds / seconds), refcheck against the CPU backend."""
    nbytes, dev = results["bytes"], results["device"]
    copy_s = 2 * nbytes / (results["copy_gbps"] * 1e9)
    out = []
    for name, r in results["backends"].items():
        for op in ("quantize", "quantize_pts", "dequantize"):
            s = nbytes / (r[f"{op}_gbps"] * 1e9)
            out.append(Row(f"{name} {op}", s, copy_s / s, "device copy", f"{nbytes / 2**30:.2f} GiB bf16", dev,
                           r["refcheck"]))
    return out


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if not have_cuda():
        return 1
    n_rows = max(1, int(args.gib * (1 << 30)) // 2 // args.cols)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(n_rows, args.cols, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    nbytes = x.numel() * 2
    copy_s, copy_gbps = device_copy(x, args.repeats)  # read + write
    print(f"{torch.cuda.get_device_name()}: {n_rows}x{args.cols} bf16 ({nbytes / 2**30:.2f} GiB); device copy "
          f"{copy_gbps:.0f} GB/s (read+write) is the yardstick")
    want = nvfp4.quantize(x.cpu(), backend="cpu")
    want_deq = nvfp4.dequantize(want, torch.bfloat16, backend="cpu")
    results = {"device": torch.cuda.get_device_name(), "bytes": nbytes, "copy_gbps": copy_gbps, "backends": {}}
    for name in ("cuda", "triton"):
        why = available(name, "cuda")
        if why:
            print(f"{name}: unavailable ({why})")
            continue
        results["backends"][name] = time_backend(name, x, want, want_deq, args.repeats, copy_gbps)
    if len(results["backends"]) == 2:
        a, b = results["backends"]["cuda"], results["backends"]["triton"]
        print(f"cuda/triton: quantize {a['quantize_gbps'] / b['quantize_gbps']:.2f}x, quantize(pts) "
              f"{a['quantize_pts_gbps'] / b['quantize_pts_gbps']:.2f}x, dequantize "
              f"{a['dequantize_gbps'] / b['dequantize_gbps']:.2f}x")
    return finish("gpu_nvfp4", args, results, rows(results))


if __name__ == "__main__":
    sys.exit(main())
