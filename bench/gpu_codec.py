"""GPU halves of the codec, timed on the device: checksum, changed-word scan + compaction, full encode
(scan on the GPU, compact list over PCIe, entropy coding on the host) and apply (decode on the host, compact
list over PCIe, scatter + two checksums on the GPU), per GPU backend and delta format (format 2 also
computes the old elements' classes on the GPU and copies them, half a byte each, to the host), next to a
device-to-device copy of the same bytes (the HBM bandwidth yardstick) measured in the same run. ``--refcheck``
compares every backend's blobs and applied result with the CPU codec's. Writes JSON (``--json``).

    python -m bench.gpu_codec --gib 1 --density 0.01 --refcheck
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench._report import Row, finish, output_flags
from bench._timing import cuda_time, device_copy, have_cuda
from syncd.ops import available, checksum, delta


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_codec", description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0, help="bf16 tensor size in GiB")
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--versions", default="1,2", help="delta formats to time")
    output_flags(p, "gpu_codec", refcheck="check every backend's output against the CPU codec")
    return p


def weight_delta(gib: float, density: float) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 weights on the GPU (``gib`` GiB) and a copy with ``density`` of the words moved by one unit in the last
    place (seeded)."""
    n = int(gib * (1 << 30)) // 2
    g = torch.Generator(device="cuda").manual_seed(0)
    old = (torch.randn(n, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    bits = old.view(torch.int16)
    mask = torch.rand(n, device="cuda", generator=g) < density
    step = torch.where(torch.rand(n, device="cuda", generator=g) < 0.5, -1, 1).to(torch.int16)
    return old, torch.where(mask, bits + step, bits).view(torch.bfloat16)


def time_format(name: str, v: int, old, new, repeats: int, copy_s: float, ref_blob) -> dict:
    """Encode and apply of format ``v`` on backend ``name`` (GB/s of weights; apply without its scratch copy), the
    blob's size, and, given the CPU codec's blob ``ref_blob``, whether blob and result match it."""
    nbytes = old.numel() * 2
    enc_s = cuda_time(lambda: delta.encode(old, new, backend=name, version=v), max(3, repeats // 3))
    blob = delta.encode(old, new, backend=name, version=v)
    work = old.clone()

    def apply_once():
        work.copy_(old)
        delta.apply_(work, blob, backend=name)
    app_s = cuda_time(apply_once, max(3, repeats // 3)) - copy_s
    ok = None
    if ref_blob is not None:
        ok = blob == ref_blob and torch.equal(work.view(torch.int16), new.view(torch.int16))
    return {"encode_gbps": nbytes / enc_s / 1e9, "apply_gbps": nbytes / app_s / 1e9, "blob_bytes": len(blob),
            "blob_pct": 100 * len(blob) / nbytes, "refcheck": ok}


def time_backend(name: str, old, new, versions, repeats: int, copy_s: float, ref_blobs: dict) -> dict:
    """Checksum and changed-word scan of backend ``name`` (GB/s, % of the copy's rate) and every format's
    :func:`time_format`, printed as they come."""
    nbytes = old.numel() * 2
    read_gbps_limit = 2 * nbytes / copy_s / 1e9  # a read-only pass cannot beat the copy's total traffic rate
    ck_s = cuda_time(lambda: checksum(old, backend=name), repeats)
    scan_s = cuda_time(lambda: delta.find_changes(old, new, backend=name), repeats)
    r = {"checksum_gbps": nbytes / ck_s / 1e9, "scan_gbps": 2 * nbytes / scan_s / 1e9,
         "checksum_pct_of_copy": 100 * (nbytes / ck_s / 1e9) / read_gbps_limit,
         "scan_pct_of_copy": 100 * (2 * nbytes / scan_s / 1e9) / read_gbps_limit, "formats": {}}
    print(f"{name:6s} checksum {r['checksum_gbps']:7.0f} GB/s ({r['checksum_pct_of_copy']:.0f}% of copy)  "
          f"scan {r['scan_gbps']:7.0f} GB/s read ({r['scan_pct_of_copy']:.0f}%)")
    for v in versions:
        f = r["formats"][str(v)] = time_format(name, v, old, new, repeats, copy_s, ref_blobs.get(v))
        print(f"{name:6s} format {v}: encode {f['encode_gbps']:6.1f} GB/s  apply {f['apply_gbps']:6.1f} GB/s of "
              f"weights  blob {f['blob_pct']:.3f}%  refcheck {f['refcheck']}")
    return r


def rows(results: dict) -> list[Row]:
    """The shared columns: every backend's checksum, scan, encode and apply against a device copy of the same
    bytes (ratio: copy seconds / seconds), with the format rows' refcheck."""
    nbytes, dev = results["bytes"], results["device"]
    copy_s = 2 * nbytes / (results["copy_gbps"] * 1e9)
    sizes = f"{nbytes / 2**30:.2f} GiB bf16 {100 * results['density']:g}%"
    out = []
    for name, r in results["backends"].items():
        for what, gbps, per_byte in (("checksum", r["checksum_gbps"], 1), ("scan", r["scan_gbps"], 2)):
            s = per_byte * nbytes / (gbps * 1e9)
            out.append(Row(f"{name} {what}", s, copy_s / s, "device copy", sizes, dev))
        for v, f in r["formats"].items():
            for op in ("encode", "apply"):
                s = nbytes / (f[f"{op}_gbps"] * 1e9)
                out.append(Row(f"{name} format {v} {op}", s, copy_s / s, "device copy", sizes, dev, f["refcheck"]))
    return out


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if not have_cuda():
        return 1
    old, new = weight_delta(args.gib, args.density)
    nbytes = old.numel() * 2
    copy_s, copy_gbps = device_copy(old, args.repeats)  # read + write
    print(f"{torch.cuda.get_device_name()}: {args.gib:g} GiB bf16, density {args.density:g}; "
          f"device copy {copy_gbps:.0f} GB/s (read+write) is the yardstick")
    results = {"device": torch.cuda.get_device_name(), "bytes": nbytes, "density": args.density,
               "copy_gbps": copy_gbps, "backends": {}}
    versions = [int(x) for x in args.versions.split(",")]
    ref_blobs = {}
    if args.refcheck:
        ref_blobs = {v: delta.encode(old.cpu(), new.cpu(), backend="cpu", version=v) for v in versions}
    for name in ("cuda", "triton"):
        why = available(name, "cuda")
        if why:
            print(f"{name}: unavailable ({why})")
            continue
        results["backends"][name] = time_backend(name, old, new, versions, args.repeats, copy_s, ref_blobs)
    if len(results["backends"]) == 2:
        a, b = results["backends"]["cuda"], results["backends"]["triton"]
        print(f"cuda/triton: checksum {a['checksum_gbps'] / b['checksum_gbps']:.2f}x, scan "
              f"{a['scan_gbps'] / b['scan_gbps']:.2f}x, " + ", ".join(
                  f"format {v} encode {a['formats'][v]['encode_gbps'] / b['formats'][v]['encode_gbps']:.2f}x, "
                  f"apply {a['formats'][v]['apply_gbps'] / b['formats'][v]['apply_gbps']:.2f}x" for v in a["formats"]))
    return finish("gpu_codec", args, results, rows(results))


if __name__ == "__main__":
    sys.exit(main())
