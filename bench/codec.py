"""Codec benchmark on real RL-like weight deltas: format 1 and format 2 side by side.

Builds a small decoder LM from a transformers config (random init), keeps fp32 master weights, takes AdamW
steps on a policy-gradient loss at RL learning rates, and compares bf16 snapshots K steps apart. For each
(lr, K) it prints density, the encoded size of both formats (% of the bf16 weights) against the order-0
entropy bound, and encode / apply throughput of both as ratios to a NumPy read pass, and, measured in the same
run over the same bytes: (a) zstd of the new weights, (b) zstd of old XOR new, (c) int32 index + bf16 value +
zstd, (e) gap varints + zigzag key deltas + zstd (``bench/_codec_refs.py``). Encode and apply are timed
through ``encode_many`` / ``apply_many`` (all cores across and within tensors, what a publisher and an
engine call). The read pass, both formats' encode and apply and the checksum take turns in each timing
round and the ratios to the read pass are the medians of the per-round ratios, so a noisy neighbour moves
numerator and denominator together. Physical limits, measured in the same rounds: encode reads old and new
(2 bytes per full-weight byte) and apply at least the target, so their ratios cannot pass a read of those
bytes with both cores (timed with our memory-speed checksum). ``--refcheck`` also decodes every blob with the
``reference`` backend (the plain-PyTorch spec) and compares it with the new weights, bit for bit (slow: seconds per
million words for format 2). Writes JSON (``--json``); ``--plot`` draws a PNG.

    python -m bench.codec                 # ~110M parameters, lr 1e-6/3e-6/1e-5, K = 1, 2, 4, 8
    python -m bench.codec --preset tiny   # seconds; what the test runs
"""

from __future__ import annotations

import argparse
import logging
import platform
import statistics
import sys

import numpy as np
import torch

from bench._codec_refs import baselines, entropy_bound
from bench._report import Row, finish, output_flags
from bench._timing import Stopwatch, median_time
from syncd.ops import checksum_many, delta, native_features, threads

log = logging.getLogger("bench.codec")

PRESETS = {
    "default": dict(hidden=768, layers=12, heads=12, kv_heads=4, intermediate=2048, vocab=16000, batch=2, seq=64,
                    warmup=10, repeats=5),
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=512, batch=2, seq=16,
                 warmup=1, repeats=2),
}


def build_model(cfg: dict, seed: int) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from syncd.lazy import quiet_optional_imports

    quiet_optional_imports()
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


VERSIONS = (1, 2)


def round_trips(olds: list, news: list, blobs: list, backend: str) -> bool:
    """Whether every blob decoded by ``backend`` onto its old tensor gives the new one, bit for bit."""
    return all(torch.equal(delta.decode(o, b, backend=backend).view(torch.int16), n.view(torch.int16))
               for o, n, b in zip(olds, news, blobs))


def measure_case(old: dict, new: dict, repeats: int, block_log2: int, refcheck: bool = False) -> dict:
    """Sizes and throughputs of both formats on one delta (``old`` -> ``new``, dicts of bf16 tensors), timed in
    shared rounds with the read pass and the bandwidth limits; per format under ``result["formats"]`` (with
    ``refcheck``, its ``"refcheck"``: the reference backend's decode round trip). AssertionError when the CPU
    backend's own round trip fails."""
    nbytes = sum(t.numel() * t.element_size() for t in old.values())
    names = list(old)
    olds, news = [old[k] for k in names], [new[k] for k in names]
    blobs = {v: delta.encode_many(olds, news, backend="cpu", block_log2=block_log2, version=v) for v in VERSIONS}
    for v in VERSIONS:  # correctness, on every case
        if not round_trips(olds, news, blobs[v], "cpu"):
            raise AssertionError(f"format {v} round trip failed")
    work = [o.clone() for o in olds]

    def reset():
        for w, o in zip(work, olds):
            w.copy_(o)
    # the read pass, both formats' encode and apply, and the checksum take turns in every round, so a noisy
    # neighbour slows all of them alike; the ratios are the medians of the per-round ratios
    read_once = numpy_read_pass(new, 1, warm=True)
    # bandwidth limits, same rounds: encode must read old and new, apply at least the target; the fastest
    # reader we have is the checksum (memory speed, both cores), over the same bytes in one buffer per side
    old_cat = torch.cat([t.reshape(-1) for t in olds])
    new_cat = torch.cat([t.reshape(-1) for t in news])
    rounds = []
    for _ in range(repeats):
        r = {"read": read_once(), "both": median_time(lambda: checksum_many([old_cat, new_cat]), 1),
             "one": median_time(lambda: checksum_many([old_cat]), 1)}
        for v in VERSIONS:
            r[f"enc{v}"] = median_time(
                lambda v=v: delta.encode_many(olds, news, backend="cpu", block_log2=block_log2, version=v), 1)
            r[f"app{v}"] = median_time(lambda v=v: delta.apply_many(work, blobs[v], backend="cpu"), 1, setup=reset)
        r["ck"] = median_time(lambda: checksum_many(news), 1)
        rounds.append(r)
    med = lambda key: statistics.median(x[key] for x in rounds)  # noqa: E731
    ratio = lambda key: statistics.median(x["read"] / x[key] for x in rounds)  # noqa: E731
    bound = entropy_bound(old, new)
    base = baselines(old, new, repeats)
    gbps = lambda sec: nbytes / sec / 1e9  # noqa: E731
    formats = {}
    for v in VERSIONS:
        size = sum(len(b) for b in blobs[v])
        sections: dict = {"header": 0}
        for b in blobs[v]:
            info = delta.inspect(b)
            sections["header"] += info["header_bytes"]
            for sec, n in info["sections"].items():
                sections[sec] = sections.get(sec, 0) + n
        formats[str(v)] = {
            "encoded_bytes": size, "encoded_pct": 100 * size / nbytes,
            "ratio_to_bound": size / bound["per_tensor_bytes"] if bound["per_tensor_bytes"] else float("nan"),
            "sections": sections, "encode_gbps": gbps(med(f"enc{v}")), "apply_gbps": gbps(med(f"app{v}")),
            "encode_vs_read": ratio(f"enc{v}"), "apply_vs_read": ratio(f"app{v}"),
            "encode_changes_per_s": bound["changed"] / med(f"enc{v}"),
            "apply_changes_per_s": bound["changed"] / med(f"app{v}"),
            "encode_vs_v1": statistics.median(x["enc1"] / x[f"enc{v}"] for x in rounds),
            "apply_vs_v1": statistics.median(x["app1"] / x[f"app{v}"] for x in rounds),
        }
        if refcheck:
            formats[str(v)]["refcheck"] = round_trips(olds, news, blobs[v], "reference")
    smallest = min(f["encoded_bytes"] for f in formats.values())
    return {
        "bytes_bf16": nbytes, "numel": bound["numel"], "changed": bound["changed"],
        "density": bound["changed"] / bound["numel"], "bound_bytes": bound["per_tensor_bytes"],
        "bound_pct": 100 * bound["per_tensor_bytes"] / nbytes, "global_bound_bytes": bound["global_bytes"],
        "bound_positions_bytes": bound["positions_bytes"], "bound_values_bytes": bound["values_bytes"],
        "formats": formats, "numpy_read_gbps": gbps(med("read")), "checksum_gbps": gbps(med("ck")),
        "checksum_vs_read": ratio("ck"), "encode_vs_read_limit": ratio("both"), "apply_vs_read_limit": ratio("one"),
        "rounds": len(rounds),
        "baselines": {k: {"bytes": n, "pct": 100 * n / nbytes, "x_smallest": n / smallest,
                          "encode_gbps": gbps(base["encode_s"][k]) if base["encode_s"][k] else None}
                      for k, n in base["sizes"].items()},
    }


def measure_case_quiet(old: dict, new: dict, repeats: int, block_log2: int, refcheck: bool = False) -> dict:
    """``measure_case`` with torch's intra-op pool at one thread: the harness's own torch calls (copies,
    comparisons) otherwise leave OpenMP workers spinning on the two cores the codec is being timed on."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return measure_case(old, new, repeats, block_log2, refcheck)
    finally:
        torch.set_num_threads(before)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.codec", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="default")
    p.add_argument("--lrs", default="1e-6,3e-6,1e-5", help="comma-separated learning rates")
    p.add_argument("--ks", default="1,2,4,8", help="comma-separated snapshot distances in optimizer steps")
    p.add_argument("--repeats", type=int, help="timing rounds (medians of per-round ratios are reported)")
    p.add_argument("--block-log2", type=int, default=delta.DEFAULT_BLOCK_LOG2)
    p.add_argument("--seed", type=int, default=0)
    output_flags(p, "codec", refcheck="also decode every blob with the reference backend and compare it with the "
                                      "new weights bit for bit (slow)")
    return p


HEADER = (f"{'lr':>7} {'K':>2} {'density':>8} {'bound%':>7} | {'v1%':>7} {'v2%':>7} {'v1/bnd':>6} {'v2/bnd':>6} | "
          f"{'enc/read v1':>11} {'v2':>5} {'app/read v1':>11} {'v2':>5} | {'zstd xor%':>9} {'i32+bf16%':>9} "
          f"{'gap+zz zstd%':>12}")


def row_text(r: dict) -> str:
    f1, f2, b = r["formats"]["1"], r["formats"]["2"], r["baselines"]
    return (f"{r['lr']:7.0e} {r['k']:2d} {100 * r['density']:7.3f}% {r['bound_pct']:6.3f}% | "
            f"{f1['encoded_pct']:6.3f}% {f2['encoded_pct']:6.3f}% {f1['ratio_to_bound']:6.3f} {f2['ratio_to_bound']:6.3f} | "
            f"{f1['encode_vs_read']:11.3f} {f2['encode_vs_read']:5.3f} {f1['apply_vs_read']:11.3f} {f2['apply_vs_read']:5.3f} | "
            f"{b['zstd_xor']['pct']:8.3f}% {b['idx32_bf16_zstd']['pct']:8.3f}% {b['gapvarint_zigzag_zstd']['pct']:11.3f}%")


def plot(results: list[dict], path) -> None:
    """Size against density on log scales (both formats, the order-0 entropy bound, the zstd baselines) and speed
    against density (encode and apply over a NumPy read pass)."""
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    from bench._plot import pyplot, save

    plt = pyplot()
    rs = sorted(results, key=lambda r: r["density"])
    x = [100 * r["density"] for r in rs]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    a.plot(x, [r["bound_pct"] for r in rs], "k-", lw=2, label="order-0 entropy bound")
    for v, style in (("1", "o--"), ("2", "s-")):
        a.plot(x, [r["formats"][v]["encoded_pct"] for r in rs], style, label=f"syncd format {v}")
        b.plot(x, [r["formats"][v]["encode_vs_read"] for r in rs], style, label=f"encode, format {v}")
        b.plot(x, [r["formats"][v]["apply_vs_read"] for r in rs], style, label=f"apply, format {v}", alpha=0.6)
    for key, label in (("zstd_xor", "zstd(old xor new)"), ("idx32_bf16_zstd", "int32 index + bf16 + zstd"),
                       ("gapvarint_zigzag_zstd", "gap varint + zigzag + zstd")):
        a.plot(x, [r["baselines"][key]["pct"] for r in rs], ":", marker=".", label=label)
    a.plot(x, x, color="grey", lw=0.8, label="y = density")
    a.set(xscale="log", yscale="log", xlabel="changed words (%)", ylabel="delta size (% of the bf16 weights)",
          title="size: ours, the bound and the baselines")
    b.set(xscale="log", xlabel="changed words (%)", ylabel="throughput / NumPy read pass", title="speed")
    for ax in (a, b):
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
    a.legend(fontsize=7)
    b.legend(fontsize=7)
    save(fig, path)


def rows(results: list[dict]) -> list[Row]:
    """The shared columns: encode and apply of each format in each case, against the NumPy read pass of the
    same bytes (ratio: the median of per-round ratios)."""
    out = []
    for r in results:
        sizes = f"{r['params'] / 1e6:.1f}M bf16 lr {r['lr']:g} K={r['k']} {100 * r['density']:.2f}%"
        for v, f in r["formats"].items():
            for op in ("encode", "apply"):
                out.append(Row(f"format {v} {op}", r["bytes_bf16"] / (f[f"{op}_gbps"] * 1e9), f[f"{op}_vs_read"],
                               "NumPy read pass", sizes, refcheck=f.get("refcheck")))
    return out


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = dict(PRESETS[args.preset])
    if args.repeats:
        cfg["repeats"] = args.repeats
    lrs = [float(x) for x in args.lrs.split(",")]
    ks = sorted(int(x) for x in args.ks.split(","))
    results = []
    print(f"syncd codec benchmark: preset {args.preset}, threads {threads()}, native SIMD "
          f"{native_features()['codec_simd']}, {platform.processor() or platform.machine()}")
    for lr in lrs:
        t0 = Stopwatch()
        snaps = snapshots(cfg, lr, max(ks), args.seed)
        nparams = sum(t.numel() for t in snaps[0].values())
        print(f"\nlr {lr:g}: {nparams / 1e6:.1f}M parameters, {max(ks) + cfg['warmup']} AdamW steps in "
              f"{t0.elapsed:.1f}s")
        print(HEADER)
        for k in ks:
            r = measure_case_quiet(snaps[0], snaps[k], cfg["repeats"], args.block_log2, args.refcheck)
            r.update(lr=lr, k=k, params=nparams)
            results.append(r)
            print(row_text(r))
    med = lambda f, key: statistics.median(r["formats"][f][key] for r in results)  # noqa: E731
    for f in ("1", "2"):
        print(f"format {f}: worst ratio to the entropy bound {max(r['formats'][f]['ratio_to_bound'] for r in results):.3f}; "
              f"medians over cases: encode/read {med(f, 'encode_vs_read'):.3f}, apply/read {med(f, 'apply_vs_read'):.3f}")
    print(f"format 2 against format 1 in the same rounds (medians over cases): size "
          f"{statistics.median(r['formats']['2']['encoded_bytes'] / r['formats']['1']['encoded_bytes'] for r in results):.3f}x, "
          f"encode {med('2', 'encode_vs_v1'):.2f}x as fast, apply {med('2', 'apply_vs_v1'):.2f}x; checksum/read "
          f"{statistics.median(r['checksum_vs_read'] for r in results):.2f} (NumPy read "
          f"{statistics.median(r['numpy_read_gbps'] for r in results):.1f} GB/s)")
    first = results[0]
    print(f"lr {first['lr']:g} K={first['k']}: format 2 encoded {first['formats']['2']['encoded_pct']:.3f}% of bf16 "
          f"({first['formats']['2']['ratio_to_bound']:.3f}x the bound; format 1 {first['formats']['1']['ratio_to_bound']:.3f}x); "
          f"bandwidth limits: encode/read {first['encode_vs_read_limit']:.2f}, apply/read {first['apply_vs_read_limit']:.2f}")
    out = {"bench": "codec", "preset": args.preset, "config": cfg, "threads": threads(),
           "simd": native_features()["codec_simd"], "python": sys.version.split()[0], "torch": torch.__version__,
           "results": results}
    return finish("codec", args, out, rows(results), lambda path: plot(results, path))


if __name__ == "__main__":
    sys.exit(main())
