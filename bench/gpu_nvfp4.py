"""NVFP4 quantize / dequantize on the GPU backends (CUDA C++ and Triton), timed on the device next to a
device-to-device copy of the same bytes (the HBM yardstick) in the same run, with a bit-for-bit check of every
backend's output against the native CPU backend. Figures are GB/s of bf16 (read by quantize, written by
dequantize). Writes JSON.

    python -m bench.gpu_nvfp4 --gib 1
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from bench._timing import cuda_time
from syncd.ops import available, nvfp4


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_nvfp4", description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0, help="bf16 tensor size in GiB")
    p.add_argument("--cols", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", default="bench/results/gpu_nvfp4.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to time")
        return 1
    rows = max(1, int(args.gib * (1 << 30)) // 2 // args.cols)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(rows, args.cols, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    nbytes = x.numel() * 2
    copy_s = cuda_time(lambda: x.clone(), args.repeats)
    copy_gbps = 2 * nbytes / copy_s / 1e9
    print(f"{torch.cuda.get_device_name()}: {rows}x{args.cols} bf16 ({nbytes / 2**30:.2f} GiB); device copy "
          f"{copy_gbps:.0f} GB/s (read+write) is the yardstick")
    want = nvfp4.quantize(x.cpu(), backend="cpu")
    want_deq = nvfp4.dequantize(want, torch.bfloat16, backend="cpu")
    pts = want.per_tensor_scale.cuda()
    results = {"device": torch.cuda.get_device_name(), "bytes": nbytes, "copy_gbps": copy_gbps, "backends": {}}
    for name in ("cuda", "triton"):
        why = available(name, "cuda")
        if why:
            print(f"{name}: unavailable ({why})")
            continue
        q_s = cuda_time(lambda: nvfp4.quantize(x, backend=name), args.repeats)
        qp_s = cuda_time(lambda: nvfp4.quantize(x, per_tensor_scale=pts, backend=name), args.repeats)
        q = nvfp4.quantize(x, backend=name)
        out = torch.empty_like(x)
        d_s = cuda_time(lambda: nvfp4.dequantize(q, torch.bfloat16, out=out, backend=name), args.repeats)
        ok = (torch.equal(q.qdata.cpu(), want.qdata) and torch.equal(q.scales.cpu().view(torch.uint8),
                                                                       want.scales.view(torch.uint8))
              and torch.equal(q.per_tensor_scale.cpu(), want.per_tensor_scale)
              and torch.equal(out.cpu().view(torch.int16), want_deq.view(torch.int16)))
        r = {"quantize_gbps": nbytes / q_s / 1e9, "quantize_pts_gbps": nbytes / qp_s / 1e9,
             "dequantize_gbps": nbytes / d_s / 1e9, "refcheck": ok}
        # traffic: quantize reads 2 B and writes 0.5625 B per element; dequantize the reverse
        r["quantize_pts_pct_of_copy"] = 100 * (nbytes * 2.5625 / 2 / qp_s / 1e9) / copy_gbps
        r["dequantize_pct_of_copy"] = 100 * (nbytes * 2.5625 / 2 / d_s / 1e9) / copy_gbps
        results["backends"][name] = r
        print(f"{name:6s} quantize {r['quantize_gbps']:7.0f} GB/s (pts computed, incl. the amax pass and the NaN "
              f"check sync)  quantize(pts) {r['quantize_pts_gbps']:7.0f} GB/s ({r['quantize_pts_pct_of_copy']:.0f}% "
              f"of copy traffic)  dequantize {r['dequantize_gbps']:7.0f} GB/s ({r['dequantize_pct_of_copy']:.0f}%)  "
              f"refcheck {ok}")
    if len(results["backends"]) == 2:
        a, b = results["backends"]["cuda"], results["backends"]["triton"]
        print(f"cuda/triton: quantize {a['quantize_gbps'] / b['quantize_gbps']:.2f}x, quantize(pts) "
              f"{a['quantize_pts_gbps'] / b['quantize_pts_gbps']:.2f}x, dequantize "
              f"{a['dequantize_gbps'] / b['dequantize_gbps']:.2f}x")
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(results, indent=1))
    bad = [k for k, r in results["backends"].items() if not r["refcheck"]]
    if bad:
        print(f"REFCHECK FAILED: {bad}")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
