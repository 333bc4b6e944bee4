"""The replay ops on the GPU (Triton): ``kept_logprobs`` forward + backward next to the naive masked
log-softmax (build a [T, V] mask, fill -inf, log_softmax, gather) and the lm_head matmul of the same T, timed
with CUDA events in the same run, with peak device memory above the inputs; the result is checked against the
plain-PyTorch reference on the same device (``--refcheck``). Kept-set sizes as in ``bench.replay``. Also rebuilding
kept sets of those sizes from the logits (``rebuild_kept``: ``kept_sets`` with sizes, topk on the device), checked
against the CPU (``--refcheck``). Writes JSON (``--json``).

    python -m bench.gpu_replay --rows 8192 --refcheck
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench._report import Row, finish, output_flags
from bench._timing import cuda_time
from bench.replay_bytes import kept_sizes_public, random_sets

TOLERANCE = 1e-4  # the largest |triton - reference| log-prob the refcheck accepts


def _peak(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_replay", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=4096, help="lm_head input size")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    p.add_argument("--repeats", type=int, default=10)
    output_flags(p, "gpu_replay", refcheck="compare the Triton op with the reference backend (max |error| below "
                                          f"{TOLERANCE:g}) and the rebuilt kept sets with the CPU's")
    return p


def kept_inputs(T: int, V: int):
    """Kept sets of the public size distribution on the GPU: (sizes on the host, ids, offsets, targets: the first
    kept id of each row)."""
    gen = torch.Generator().manual_seed(0)
    sizes = kept_sizes_public(T, gen, 1000)
    ids = torch.cat(random_sets(sizes, V, gen)).cuda()
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)]).cuda()
    return sizes, ids, offsets, ids[offsets[:-1]]


def time_op(args, x, ids, offsets, targets) -> dict:
    """``kept_logprobs`` forward + backward on Triton against the naive masked log-softmax, with peak memory, and
    the lm_head matmul of the same rows."""
    from syncd.ops.replay import kept_rows
    from syncd.ops.replay import kept_logprobs

    T, V, dt = args.rows, args.vocab, getattr(torch, args.dtype)
    rows = kept_rows(offsets)

    def ours():
        kept_logprobs(x, ids, offsets, targets, backend="triton").sum().backward()
        x.grad = None

    def naive():
        mask = torch.zeros(T, V, dtype=torch.bool, device="cuda")
        mask[rows, ids] = True
        z = x.float().masked_fill(~mask, float("-inf"))
        torch.log_softmax(z, -1).gather(1, targets[:, None]).sum().backward()
        x.grad = None

    h = torch.randn(T, args.hidden, device="cuda", dtype=dt)
    w = torch.randn(V, args.hidden, device="cuda", dtype=dt)
    return {"rows": T, "vocab": V, "dtype": args.dtype, "kept_ids": int(ids.numel()),
            "gpu": torch.cuda.get_device_name(), "triton_s": cuda_time(ours, args.repeats),
            "triton_peak_bytes": _peak(ours), "naive_s": cuda_time(naive, max(1, args.repeats // 2)),
            "naive_peak_bytes": _peak(naive),
            "lm_head_s": cuda_time(lambda: torch.nn.functional.linear(h, w), args.repeats), "hidden": args.hidden}


def check(res: dict, x, sizes, ids, offsets, targets, rebuilt, ks) -> None:
    """``--refcheck``: ``max_abs_err`` of Triton against the reference backend, and ``rebuild_refcheck``: every
    rebuilt row verified and the first 64 rows' sets equal to the CPU's."""
    from syncd.ops.replay import kept_logprobs, kept_sets

    got = kept_logprobs(x.detach(), ids, offsets, targets, backend="triton")
    want = kept_logprobs(x.detach(), ids, offsets, targets, backend="reference")
    res["max_abs_err"] = float((got - want).abs().max())
    cpu = kept_sets(x.detach()[:64].cpu(), sizes=sizes[:64])
    res["rebuild_refcheck"] = bool((rebuilt.status == 0).all()) and torch.equal(
        ks.ids[:int(ks.offsets[64])].cpu(), cpu.ids)


def rows(res: dict) -> list[Row]:
    """The shared columns: the Triton op against the naive masked log-softmax, and rebuilding the kept sets against
    the op itself."""
    sizes, dev = f"T={res['rows']} V={res['vocab']} {res['dtype']}", res["gpu"]
    err = res.get("max_abs_err")
    return [Row("triton kept_logprobs fwd+bwd", res["triton_s"], res["speedup"], "naive masked log-softmax", sizes,
                dev, None if err is None else err < TOLERANCE),
            Row("rebuild_kept on the GPU", res["rebuild_s"], 1 / res["rebuild_fraction_of_kept_logprobs"],
                "kept_logprobs fwd+bwd", sizes, dev, res.get("rebuild_refcheck"))]


def main(argv=None) -> int:
    from syncd.ops.replay import kept_fingerprint, kept_sets, rebuild_kept

    args = parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to time")
        return 1
    T, V = args.rows, args.vocab
    sizes, ids, offsets, targets = kept_inputs(T, V)
    x = torch.randn(T, V, device="cuda").to(getattr(torch, args.dtype)).requires_grad_()
    res = time_op(args, x, ids, offsets, targets)
    top = sizes.cuda()
    none = torch.zeros(T + 1, dtype=torch.int64, device="cuda")
    ks = kept_sets(x.detach(), sizes=top)
    fps = kept_fingerprint(ks.ids, ks.offsets)
    res["rebuild_s"] = cuda_time(lambda: rebuild_kept(x.detach(), top, none[:0], none, fps), args.repeats)
    res["rebuild_fraction_of_kept_logprobs"] = res["rebuild_s"] / res["triton_s"]
    res["speedup"] = res["naive_s"] / res["triton_s"]
    res["memory_ratio"] = res["naive_peak_bytes"] / max(res["triton_peak_bytes"], 1)
    res["lm_head_fraction"] = res["triton_s"] / res["lm_head_s"]
    if args.refcheck:
        check(res, x, sizes, ids, offsets, targets, rebuild_kept(x.detach(), top, none[:0], none, fps), ks)
    print(f"{res['gpu']}: T={T}, V={V} {args.dtype}, {res['kept_ids']} kept ids: triton {res['triton_s'] * 1e3:.2f} ms, "
          f"naive {res['naive_s'] * 1e3:.2f} ms ({res['speedup']:.1f}x), peak {res['triton_peak_bytes'] / 2**20:.0f} vs "
          f"{res['naive_peak_bytes'] / 2**20:.0f} MiB ({res['memory_ratio']:.1f}x); lm_head [T, {args.hidden}] "
          f"{res['lm_head_s'] * 1e3:.2f} ms ({100 * res['lm_head_fraction']:.2f}%)"
          + (f"; max |triton - reference| {res['max_abs_err']:.2e}" if args.refcheck else "")
          + f"; rebuilding every set from the logits {res['rebuild_s'] * 1e3:.2f} ms "
            f"({res['rebuild_fraction_of_kept_logprobs']:.2f}x the op)"
          + (f", same sets as the CPU: {res['rebuild_refcheck']}" if args.refcheck else ""))
    return finish("gpu_replay", args, res, rows(res))


if __name__ == "__main__":
    sys.exit(main())
