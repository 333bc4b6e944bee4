"""Codec benchmark on real RL-like weight deltas.

Builds a small decoder LM from a transformers config (random init), keeps fp32 master weights, takes AdamW
steps on a policy-gradient loss at RL learning rates, and compares bf16 snapshots K steps apart. For each
(lr, K) it prints density, our encoded size (% of the bf16 weights) against the entropy bound, encode /
decode / apply throughput in GB/s of full-weight bytes, and, measured in the same run over the same bytes:
(a) zstd of the new weights, (b) zstd of old XOR new, (c) int32 index + bf16 value + zstd, (e) gap varints +
zigzag key deltas + zstd (our streams with zstd instead of our coder), and (d) a NumPy read pass, the
memory-speed yardstick. Encode and apply are timed through ``encode_many`` / ``apply_many`` (all cores
across and within tensors, what a publisher and an engine call); one-tensor-at-a-time figures are in the
JSON. The read pass, encode, apply and the checksum take turns in each timing round and the ratios to the
read pass are the medians of the per-round ratios, so a noisy neighbour moves numerator and denominator
together. Physical limits, measured in the same rounds: encode reads old and new (2 bytes per full-weight
byte) and apply at least the target, so their ratios cannot pass a read of those bytes with both cores
(timed with our memory-speed checksum). Where the changes are many, the entropy coder's cost per change
dominates instead (the JSON has changes/s). Writes JSON.

    python -m bench.codec                 # ~110M parameters, lr 1e-6/3e-6/1e-5, K = 1, 2, 4, 8
    python -m bench.codec --preset tiny   # seconds; what the test runs
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import zstandard

from syncd.ops import checksum_many, delta, threads
from syncd.ops.reference import delta as ref_delta

log = logging.getLogger("bench.codec")

PRESETS = {
    "default": dict(hidden=768, layers=12, heads=12, kv_heads=4, intermediate=2048, vocab=16000, batch=2, seq=64,
                    warmup=10, repeats=5),
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=512, batch=2, seq=16,
                 warmup=1, repeats=2),
}


def build_model(cfg: dict, seed: int) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    conf = Qwen2Config(hidden_size=cfg["hidden"], num_hidden_layers=cfg["layers"],
                       num_attention_heads=cfg["heads"], num_key_value_heads=cfg["kv_heads"],
                       intermediate_size=cfg["intermediate"], vocab_size=cfg["vocab"],
                       max_position_embeddings=max(128, cfg["seq"]), tie_word_embeddings=False)
    return Qwen2ForCausalLM(conf).float()


def snapshots(cfg: dict, lr: float, steps: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """bf16 snapshots after warm-up and after each of ``steps`` AdamW steps on a policy-gradient loss
    (sampled tokens, +-1 advantages): the shape of an RL update, on fp32 master weights."""
    model = build_model(cfg, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
    g = torch.Generator().manual_seed(seed + 1)
    out = []
    for step in range(cfg["warmup"] + steps):
        prompt = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g)
        logits = model(input_ids=prompt).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1)
        with torch.no_grad():
            probs = torch.softmax(logits, -1).reshape(-1, logits.shape[-1])
            actions = torch.multinomial(probs, 1, generator=g).reshape(logits.shape[:-1])
        adv = torch.randint(0, 2, (cfg["batch"], 1), generator=g).float() * 2 - 1
        chosen = logp.gather(-1, actions[..., None])[..., 0]
        loss = -(adv * chosen).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step >= cfg["warmup"] - 1:
            out.append({k: v.detach().to(torch.bfloat16).clone() for k, v in model.state_dict().items()})
    return out


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


def median_time(fn, repeats: int, setup=None) -> float:
    ts = []
    for _ in range(repeats):
        if setup:
            setup()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


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
        t0 = time.perf_counter()
        sizes["zstd_full"] += len(_zstd(n.tobytes()))
        t1 = time.perf_counter()
        sizes["zstd_xor"] += len(_zstd((o ^ n).tobytes()))
        t2 = time.perf_counter()
        idx = np.flatnonzero(o != n)
        sizes["idx32_bf16_zstd"] += len(_zstd(idx.astype(np.int32).tobytes() + n[idx].tobytes()))
        t3 = time.perf_counter()
        dt = delta.dtype_format(torch.bfloat16)
        pos, v = ref_delta.changes(o.view(np.uint16), n.view(np.uint16), dt)
        gaps = np.diff(pos, prepend=-1) - 1
        sizes["gapvarint_zigzag_zstd"] += len(_zstd(_varint_bytes(gaps)) + _zstd(_varint_bytes(v)))
        t4 = time.perf_counter()
        for k, dtm in zip(sizes, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            times[k] += dtm
    return {"sizes": sizes, "encode_s": times}


def numpy_read_pass(tensors: dict, repeats: int, warm: bool = False):
    """Median seconds of a NumPy read-only pass (``sum``) over every tensor's bytes; with ``warm``, a function
    that times one more pass instead."""
    arrays = [t.view(torch.int16).numpy() for t in tensors.values()]
    arrays = [a.view(np.uint64) if a.nbytes % 8 == 0 else a for a in arrays]

    def run():
        for a in arrays:
            a.sum()
    run()
    if warm:
        return lambda: median_time(run, 1)
    return median_time(run, repeats)


def measure_case(old: dict, new: dict, repeats: int, block_log2: int) -> dict:
    nbytes = sum(t.numel() * t.element_size() for t in old.values())
    blobs = {k: delta.encode(old[k], new[k], backend="cpu", block_log2=block_log2) for k in old}
    encoded = sum(len(b) for b in blobs.values())
    for k in old:  # correctness, on every case
        if not torch.equal(delta.decode(old[k], blobs[k], backend="cpu").view(torch.int16), new[k].view(torch.int16)):
            raise AssertionError(f"round trip failed for {k}")
    names = list(old)
    olds, news = [old[k] for k in names], [new[k] for k in names]
    work = {k: v.clone() for k, v in old.items()}

    def reset():
        for k in work:
            work[k].copy_(old[k])
    works, blob_list = [work[k] for k in names], [blobs[k] for k in names]
    # the read pass, encode and apply take turns in every round, so a noisy neighbour slows all three alike;
    # the ratios are the medians of the per-round ratios
    read_once = numpy_read_pass(new, 1, warm=True)
    # bandwidth limits, same rounds: encode must read old and new, apply at least the target; the fastest
    # reader we have is the checksum (memory speed, both cores), over the same bytes in one buffer per side
    old_cat = torch.cat([t.reshape(-1) for t in olds])
    new_cat = torch.cat([t.reshape(-1) for t in news])
    rounds = []
    for _ in range(repeats):
        r_s = read_once()
        both_s = median_time(lambda: checksum_many([old_cat, new_cat]), 1)
        one_s = median_time(lambda: checksum_many([old_cat]), 1)
        e_s = median_time(lambda: delta.encode_many(olds, news, backend="cpu", block_log2=block_log2), 1)
        a_s = median_time(lambda: delta.apply_many(works, blob_list, backend="cpu"), 1, setup=reset)
        c_s = median_time(lambda: checksum_many(news), 1)
        rounds.append((r_s, e_s, a_s, both_s, one_s, c_s))
    read_s, enc_s, app_s, _, _, ck_s = (statistics.median(x) for x in zip(*rounds))
    ck_ratio = statistics.median(x[0] / x[5] for x in rounds)
    enc_ratio = statistics.median(x[0] / x[1] for x in rounds)
    app_ratio = statistics.median(x[0] / x[2] for x in rounds)
    enc_limit = statistics.median(x[0] / x[3] for x in rounds)
    app_limit = statistics.median(x[0] / x[4] for x in rounds)
    enc1_s = median_time(lambda: [delta.encode(old[k], new[k], backend="cpu", block_log2=block_log2) for k in old],
                         repeats)
    dec_s = median_time(lambda: [delta.decode(old[k], blobs[k], backend="cpu") for k in old], repeats)
    app1_s = median_time(lambda: [delta.apply_(work[k], blobs[k], backend="cpu") for k in old], repeats, setup=reset)
    bound = entropy_bound(old, new)
    base = baselines(old, new, repeats)
    sections = {"tables": 0, "lengths": 0, "raw_bits": 0, "rans": 0, "header": 0}
    for b in blobs.values():
        info = delta.inspect(b)
        sections["header"] += info["header_bytes"]
        for s, v in info["sections"].items():
            sections[s] += v
    gbps = lambda s: nbytes / s / 1e9  # noqa: E731
    return {
        "bytes_bf16": nbytes, "numel": bound["numel"], "changed": bound["changed"],
        "density": bound["changed"] / bound["numel"], "encoded_bytes": encoded,
        "encoded_pct": 100 * encoded / nbytes, "bound_bytes": bound["per_tensor_bytes"],
        "bound_pct": 100 * bound["per_tensor_bytes"] / nbytes,
        "ratio_to_bound": encoded / bound["per_tensor_bytes"] if bound["per_tensor_bytes"] else float("nan"),
        "global_bound_bytes": bound["global_bytes"], "bound_positions_bytes": bound["positions_bytes"],
        "bound_values_bytes": bound["values_bytes"], "sections": sections,
        "encode_gbps": gbps(enc_s), "decode_gbps": gbps(dec_s), "apply_gbps": gbps(app_s),
        "encode_one_by_one_gbps": gbps(enc1_s), "apply_one_by_one_gbps": gbps(app1_s),
        "numpy_read_gbps": gbps(read_s), "checksum_gbps": gbps(ck_s), "checksum_vs_read": ck_ratio,
        "encode_vs_read": enc_ratio, "apply_vs_read": app_ratio,
        "encode_vs_read_limit": enc_limit, "apply_vs_read_limit": app_limit,
        "encode_changes_per_s": bound["changed"] / enc_s, "apply_changes_per_s": bound["changed"] / app_s,
        "decode_vs_read": read_s / dec_s,
        "baselines": {k: {"bytes": v, "pct": 100 * v / nbytes, "x_ours": v / encoded,
                          "encode_gbps": gbps(base["encode_s"][k]) if base["encode_s"][k] else None}
                      for k, v in base["sizes"].items()},
    }


def measure_case_quiet(old: dict, new: dict, repeats: int, block_log2: int) -> dict:
    """``measure_case`` with torch's intra-op pool at one thread: the harness's own torch calls (copies,
    comparisons) otherwise leave OpenMP workers spinning on the two cores the codec is being timed on."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return measure_case(old, new, repeats, block_log2)
    finally:
        torch.set_num_threads(before)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.codec", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="default")
    p.add_argument("--lrs", default="1e-6,3e-6,1e-5", help="comma-separated learning rates")
    p.add_argument("--ks", default="1,2,4,8", help="comma-separated snapshot distances in optimizer steps")
    p.add_argument("--repeats", type=int, help="timing repeats (median is reported)")
    p.add_argument("--block-log2", type=int, default=delta.DEFAULT_BLOCK_LOG2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.environ.get("SYNCD_BENCH_OUT", "bench/results/codec.json"))
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = dict(PRESETS[args.preset])
    if args.repeats:
        cfg["repeats"] = args.repeats
    lrs = [float(x) for x in args.lrs.split(",")]
    ks = sorted(int(x) for x in args.ks.split(","))
    results = []
    header = (f"{'lr':>7} {'K':>2} {'density':>8} {'ours%':>7} {'bound%':>7} {'x bound':>7} "
              f"{'enc GB/s':>8} {'dec GB/s':>8} {'app GB/s':>8} {'read GB/s':>9} {'enc/read':>8} {'app/read':>8} | "
              f"{'zstd full%':>10} {'zstd xor%':>9} {'i32+bf16%':>9} {'gap+zz zstd%':>12}")
    print(f"syncd codec benchmark: preset {args.preset}, threads {threads()}, {platform.processor() or platform.machine()}")
    for lr in lrs:
        t0 = time.perf_counter()
        snaps = snapshots(cfg, lr, max(ks), args.seed)
        nparams = sum(t.numel() for t in snaps[0].values())
        print(f"\nlr {lr:g}: {nparams / 1e6:.1f}M parameters, {max(ks) + cfg['warmup']} AdamW steps in "
              f"{time.perf_counter() - t0:.1f}s")
        print(header)
        for k in ks:
            r = measure_case_quiet(snaps[0], snaps[k], cfg["repeats"], args.block_log2)
            r.update(lr=lr, k=k, params=nparams)
            results.append(r)
            b = r["baselines"]
            print(f"{lr:7.0e} {k:2d} {100 * r['density']:7.3f}% {r['encoded_pct']:6.3f}% {r['bound_pct']:6.3f}% "
                  f"{r['ratio_to_bound']:7.3f} {r['encode_gbps']:8.2f} {r['decode_gbps']:8.2f} {r['apply_gbps']:8.2f} "
                  f"{r['numpy_read_gbps']:9.2f} {r['encode_vs_read']:8.2f} {r['apply_vs_read']:8.2f} | "
                  f"{b['zstd_full']['pct']:9.2f}% {b['zstd_xor']['pct']:8.3f}% {b['idx32_bf16_zstd']['pct']:8.3f}% "
                  f"{b['gapvarint_zigzag_zstd']['pct']:11.3f}%")
    worst = max(r["ratio_to_bound"] for r in results)
    med = lambda key: statistics.median(r[key] for r in results)  # noqa: E731
    print(f"\nworst ratio to the entropy bound: {worst:.3f}; medians over cases: encode/read "
          f"{med('encode_vs_read'):.2f}, apply/read {med('apply_vs_read'):.2f}, checksum/read "
          f"{med('checksum_vs_read'):.2f} (checksum {med('checksum_gbps'):.1f} GB/s, NumPy read "
          f"{med('numpy_read_gbps'):.1f} GB/s)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"bench": "codec", "preset": args.preset, "config": cfg, "threads": threads(),
                               "python": sys.version.split()[0], "torch": torch.__version__, "results": results},
                              indent=1))
    first, densest = results[0], max(results, key=lambda r: r["density"])
    print(f"lr {first['lr']:g} K={first['k']}: encoded {first['encoded_pct']:.3f}% of bf16, encode/read "
          f"{first['encode_vs_read']:.2f} (bandwidth limit {first['encode_vs_read_limit']:.2f}: old and new read "
          f"with both cores), apply/read {first['apply_vs_read']:.2f} (limit {first['apply_vs_read_limit']:.2f}); "
          f"densest case {100 * densest['density']:.1f}%: "
          f"{densest['encode_changes_per_s'] / 1e6:.0f}M changes/s encode, "
          f"{densest['apply_changes_per_s'] / 1e6:.0f}M apply")
    print(f"results written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
