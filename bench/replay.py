"""Replay benchmark: how closely the trainer reproduces the engine's sampling distribution, what the kept-set op
costs, and what the records cost on the wire. Everything is measured in one run, side by side.

1. **Mismatch table** (``bench.rollouts``: reference-engine workers under Dynamo, the sandbox proxy, real AdamW
   updates published and applied mid-trajectory; fp32 on CPU; dense Qwen2, Qwen3-MoE and an NVFP4-QAT Qwen2).
   The trainer reads the rollouts back (``syncd.trainer.rl.rollouts``) and recomputes every token's log-prob on the
   weight versions the engine used (``syncd.trainer.rl.logprobs.sampler_logprobs``): without replay, with kept-set
   replay, with kept-set + routing replay; the NVFP4 model with its QAT trainer. Per row: IS ratio mean, share
   of tokens outside [0.9, 1.1], max |d log p|, mismatch KL (k3; k1), routing disagreement (share of token-layer
   routes the trainer's forward used that differ from the engine's, measured at the experts). Context rows: the
   trainer on the newest weights (what an async trainer computes; staleness), the engine's own forward shapes
   (``stepwise``: the numerics floor) and, for MoE, a bf16 trainer (other numerics than the engine's, as in
   production; where routing replay matters: fp32 routers on identical weights choose what the engine chose). Public figures: TRL PR 7269 (top-p 0.8 on vLLM) ratio mean 0.896, 51.8% of
   tokens outside [0.9, 1.1]; after replay 1.001 and 4.3%.
2. **kept_logprobs vs the naive masked log-softmax** (build a [T, V] mask, fill -inf, log_softmax, gather),
   forward + backward on the same inputs, kept-set sizes drawn to match prime-rl's figures (median 2, p99 82, 46%
   single tokens): median time and peak memory above the inputs, with a dense gradient (cpu, reference) and a
   sparse one (``sparse_grad``), next to the lm_head matmul of the same T and the time of writing a [T, V]
   gradient; then the lm_head and the op together, forward and backward (where a sparse gradient pays most).
3. **Bytes per token** of kept sets and routes: on the recorded rollouts (the workers record sets to rebuild with
   tolerance ``--tolerance``; the mismatch table replays the sets the trainer rebuilt from its recomputed logits),
   and on synthetic logits at V = 151,936 whose top-p sets follow the public distribution (``bench.replay_kept``),
   format 2 at several tolerances next to format 1 (every id listed), int32 ids and the information bound of any
   listed encoding of uniformly random ids, with the share of sets listed because their boundary is fragile,
   whether every rebuild within the tolerance is exact and every one beyond it refused, and the rebuild's time next
   to ``kept_logprobs``; routes at a Qwen3-30B-A3B shape (E 128, top-8, 48 layers) at ceil(log2 E) bits against
   int32.

    python -m bench.replay                          # 3 models x 8 streams x 512 tokens; T=1024, V=151,936
    python -m bench.replay --rows 2048,8192         # the op at several T (the naive baseline where it fits)
    python -m bench.replay --preset tiny --plot replay.png
    python -m bench.replay --engine vllm --json OUT  # vLLM beside the reference engine (bench/_replay_engines.py)
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from bench._report import Row, finish, output_flags
from bench._timing import Stopwatch, time_and_peak
from bench.replay_bytes import kept_problem, print_bytes, recorded_bytes, route_bytes
from bench.replay_kept import public_kept

PRESETS = {
    "default": dict(requests=8, max_tokens=512, concurrency=8, updates=2, update_every=160, pretrain_steps=400,
                    hidden=64, vocab=151936, rows="1024", lm_hidden=2048, repeats=3, synthetic=4096, tolerance=1e-3),
    "tiny": dict(requests=2, max_tokens=24, concurrency=2, updates=1, update_every=8, pretrain_steps=10, hidden=32,
                 vocab=4096, rows="64", lm_hidden=64, repeats=1, synthetic=96, tolerance=1e-3),
}
MODELS = {"dense": dict(arch="qwen2"), "moe": dict(arch="qwen3_moe"), "nvfp4": dict(arch="qwen2", nvfp4=True)}
PUBLIC = {"trl_7269_no_replay": {"mean": 0.896, "outside_pct": 51.8}, "trl_7269_replay": {"mean": 1.001, "outside_pct": 4.3},
          "prime_rl_bytes_per_token": 32, "r3_kl": {"moe_no_replay": 1.5e-3, "moe_replay": 6.4e-4}}


# ---------------------------------------------------------------------------------------------- 1. mismatch


def _used_route_disagreement(model, seq, fn):
    """Run ``fn()`` and return the share of routed (position, layer) pairs whose experts, as the experts modules
    received them, differ from the engine's routes (None for a dense model)."""
    if seq.routes is None:
        fn()
        return None
    seen = []
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    hooks = [e.register_forward_pre_hook(lambda m, a, i=i: seen.append((i, a[1]))) for i, e in enumerate(experts)]
    try:
        fn()
    finally:
        for h in hooks:
            h.remove()
    used = [torch.cat([idx for i, idx in seen if i == layer]) for layer in range(len(experts))]
    rows = used[0].shape[0]
    rec = seq.routes[:rows].long()
    routed = rec[:, 0, 0] >= 0
    differ = torch.zeros(rows, len(experts), dtype=torch.bool)
    for layer, u in enumerate(used):
        differ[:, layer] = (u.sort(-1).values != rec[:, layer].sort(-1).values).any(-1)
    return float(differ[routed].double().mean())


def _row(name, trainer_lp, engine_lp, disagreement) -> dict:
    from syncd.trainer.rl.correction import ratio_stats

    s = ratio_stats(trainer_lp, engine_lp)
    return {"row": name, "tokens": s.tokens, "is_mean": s.mean, "outside_pct": 100 * s.outside,
            "max_abs_dlogp": s.max_abs_log_ratio, "kl_k3": s.kl_k3, "kl_k1": s.kl_k1, "routing_disagreement": disagreement}


def _recomputed(model, seq, used: list, **kw):
    """``sampler_logprobs(model, seq, **kw)``; appends to ``used`` the share of the routes its forward used that
    differ from the engine's (None for a dense model)."""
    from syncd.trainer.rl.logprobs import sampler_logprobs

    box = {}
    used.append(_used_route_disagreement(model, seq, lambda: box.update(r=sampler_logprobs(model, seq, **kw))))
    return box["r"]


def _variants(name: str, arch: str) -> tuple[dict, dict]:
    """The table's replay rows (name -> ``sampler_logprobs`` keywords) and the bf16-trainer context rows (MoE only:
    other numerics than the fp32 engine, where routing replay matters)."""
    variants = {"no replay": dict(kept=False, routing=False), "kept-set replay": dict(kept=True, routing=False),
                "kept-set + routing replay": dict(kept=True, routing=True)}
    if name == "nvfp4":
        variants = {"no replay (NVFP4 QAT trainer)": variants["no replay"],
                    "full replay (NVFP4 QAT trainer)": variants["kept-set + routing replay"]}
    bf16 = {}
    if arch != "qwen2":
        bf16 = {"bf16 trainer, kept-set replay": dict(routing=False), "bf16 trainer, kept-set + routing replay": {}}
    return variants, bf16


def recompute(run, rs, resolved, model, variants: dict, bf16: dict) -> dict:
    """Every sequence's log-probs recomputed per row: the replay ``variants`` on the sets as recorded (rebuilt from
    each recomputation's logits), the context rows on the resolved sets (bf16 or newer logits cannot rebuild every
    set); the engine's log-probs, the routes each row used, and the rebuild counts."""
    from syncd.trainer.rl.logprobs import sampler_logprobs

    newest = max(run.weights)
    model16 = run.trainer_model().to(torch.bfloat16) if bf16 else None
    rebuild = {"pending": sum(len(q.kept_pending) for q in rs.sequences if q.kept_pending is not None),
               "rebuilt": 0, "mismatches": 0, "newest_own_verified": 0, "newest_own_refused": 0}
    lps = {k: [] for k in variants}
    extra = {k: [] for k in ("newest weights, no replay", "newest weights, full replay", "engine shapes (stepwise)",
                             *bf16)}
    used = {k: [] for k in [*variants, *extra]}
    engine = []
    for recorded, seq in zip(rs.sequences, resolved):
        engine.append(seq.logprobs[seq.positions])
        for k, kw in variants.items():
            r = _recomputed(model, recorded, used[k], weights_of=run.weights_of, **kw)
            lps[k].append(r.logprobs)
            if r.kept is not None and k == list(variants)[-1]:
                rebuild["rebuilt"] += r.kept.rebuilt
                rebuild["mismatches"] += r.kept.mismatches
        extra["engine shapes (stepwise)"].append(sampler_logprobs(model, seq, weights_of=run.weights_of,
                                                                  stepwise=True).logprobs)
        for k, kw in bf16.items():
            extra[k].append(_recomputed(model16, seq, used[k], weights_of=run.weights_of, **kw).logprobs)
        model.load_state_dict(run.weights_of(newest))
        own = sampler_logprobs(model, recorded, on_mismatch="drop").kept  # a trainer a version ahead rebuilding
        rebuild["newest_own_verified"] += own.rebuilt
        rebuild["newest_own_refused"] += own.mismatches
        for k, kw in (("newest weights, no replay", dict(kept=False, routing=False)), ("newest weights, full replay", {})):
            extra[k].append(_recomputed(model, seq, used[k], **kw).logprobs)
    return {"lps": lps, "extra": extra, "used": used, "engine": torch.cat(engine), "rebuild": rebuild}


def mismatch(name: str, cfg: dict, workdir: Path) -> dict:
    """The mismatch table of one model (``MODELS[name]``) on rollouts generated in ``workdir``; RuntimeError when a
    recorded kept set does not rebuild from the sampled versions' logits."""
    from bench.rollouts import RolloutConfig, generate
    from syncd.trainer.rl.correction import mismatch_by_source
    from syncd.trainer.rl.logprobs import resolve_kept
    from syncd.trainer.rl.rollouts import read_rollouts

    rc = RolloutConfig(**MODELS[name], **{k: cfg[k] for k in ("requests", "max_tokens", "concurrency", "updates",
                                                              "update_every", "pretrain_steps", "hidden")},
                       kept_tolerance=cfg["tolerance"])
    run = generate(workdir / name, (workdir / name / "store").resolve().as_uri(), rc)
    rs = read_rollouts(run.store_url, run.run_id)
    model = run.trainer_model()
    t0 = Stopwatch()  # every set rebuilt once from the sampled versions, for the rows that need them listed
    resolved = resolve_kept(model, rs.sequences, weights_of=run.weights_of)
    resolve_s = t0.lap()
    variants, bf16 = _variants(name, rc.arch)
    rec = recompute(run, rs, resolved, model, variants, bf16)
    recompute_s = t0.lap()
    engine, rebuild, used = rec["engine"], rec["rebuild"], rec["used"]
    if rebuild["mismatches"] or rebuild["rebuilt"] != rebuild["pending"]:
        raise RuntimeError(f"{name}: {rebuild} (every recorded set must rebuild from the sampled versions' logits)")

    def dis(k):
        vals = [u for u in used[k] if u is not None]
        return statistics.fmean(vals) if vals else None

    rows = [_row(k, torch.cat(v), engine, dis(k)) for part in ("lps", "extra") for k, v in rec[part].items()]
    cat = {k: torch.cat(v) for k, v in rec["lps"].items()}
    keys = list(cat)
    versions = torch.cat([s.versions[s.positions] for s in rs.sequences])
    split = mismatch_by_source(engine, cat[keys[-1]], own_routing=cat.get("kept-set replay"), full_vocab=cat[keys[0]],
                               current=torch.cat(rec["extra"]["newest weights, no replay"]), versions=versions,
                               current_version=max(run.weights))
    kept_sizes = torch.cat([s.kept_offsets[1:] - s.kept_offsets[:-1] for s in resolved]).double()
    return {"model": name, "arch": rc.arch, "nvfp4": rc.nvfp4, "tokens": int(engine.numel()),
            "trajectories": len(rs.rollouts), "versions": sorted(run.weights), "applied_at": run.applied_at,
            "rows": rows, "sources": {"components": split.components, "total": split.total, "lag": split.lag},
            "kept_size": {"median": float(kept_sizes.median()), "mean": float(kept_sizes.mean()),
                          "p99": float(kept_sizes.quantile(0.99)), "single_pct": float(100 * (kept_sizes == 1).double().mean())},
            "bytes": recorded_bytes(run.store_url, run.run_id, resolved), "rebuild": rebuild, "resolve_s": resolve_s,
            "generate_s": run.wall_s, "recompute_s": recompute_s}


# ---------------------------------------------------------------------------------------------- 2. op


OP_METHODS = {"cpu": dict(backend="cpu"), "reference": dict(backend="reference"),
              "cpu, sparse grad": dict(backend="cpu", sparse_grad=True)}


def op_bench(T: int, V: int, H: int, repeats: int, seed: int, budget: int) -> dict:
    """The op alone (forward + backward into the logits), then the lm_head and the op together (forward and
    backward through ``linear(hidden [T, H], weight [V, H])``), each against the naive masked log-softmax."""
    from syncd.ops.replay import kept_logprobs

    gen = torch.Generator().manual_seed(seed)
    ids, offsets, targets, rows = kept_problem(T, V, gen)
    grad_bytes = T * V * 4

    def naive_loss(x):
        mask = torch.zeros(T, V, dtype=torch.bool)
        mask[rows, ids] = True
        return torch.log_softmax(x.masked_fill(~mask, float("-inf")), dim=-1).gather(1, targets[:, None]).sum()

    def run(loss_of, leaves):
        def fn():
            loss_of().backward()
            for t in leaves:
                t.grad = None
        return fn

    def measure(methods: dict, naive_fn, naive_need: int) -> dict:
        res = {}
        for name, fn in methods.items():
            t, peak = time_and_peak(fn, repeats)
            res[name] = {"s": t, "peak_bytes": peak, "peak_without_grad": peak - grad_bytes}
        if naive_need > budget:
            res["naive"] = {"skipped": f"needs about {naive_need / 2**30:.1f} GiB, the budget is {budget / 2**30:.1f} GiB"}
            return res
        t, peak = time_and_peak(naive_fn, max(1, min(repeats, 2)))
        res["naive"] = {"s": t, "peak_bytes": peak, "peak_without_grad": peak - grad_bytes}
        for name in methods:  # (peaks under 64 MiB are too close to page-size noise to divide; 1 MiB floor)
            r = res[name]
            r["speedup"] = t / r["s"]
            r["memory_ratio"] = peak / max(r["peak_bytes"], 1 << 20) if peak >= 64 << 20 else None
            r["working_memory_ratio"] = (peak - grad_bytes) / max(r["peak_without_grad"], 1 << 20) \
                if peak - grad_bytes >= 64 << 20 else None
        return res

    out = {"rows": T, "vocab": V, "kept_ids": int(ids.numel()), "grad_bytes": grad_bytes}
    out["zeros_floor_s"] = time_and_peak(lambda: torch.zeros(T, V), repeats)[0]
    x = torch.randn(T, V, generator=gen).requires_grad_()
    out["op"] = measure({k: run(lambda kw=kw: kept_logprobs(x, ids, offsets, targets, **kw).sum(), [x])
                         for k, kw in OP_METHODS.items()}, run(lambda: naive_loss(x), [x]), 6 * grad_bytes)
    del x
    out["lm_head_hidden"] = H
    if (T * H + V * H + T * V) * 4 > budget:
        return out
    h = torch.randn(T, H, generator=gen).requires_grad_()
    w = (torch.randn(V, H, generator=gen) / H ** 0.5).requires_grad_()
    linear = torch.nn.functional.linear
    out["lm_head_s"] = time_and_peak(lambda: linear(h.detach(), w.detach()), max(1, min(repeats, 2)))[0]
    out["lm_head_fraction"] = {k: r["s"] / out["lm_head_s"] for k, r in out["op"].items() if "s" in r}
    if 7 * grad_bytes <= budget:  # (only where the baseline runs too: each pass is several lm_head matmuls)
        e2e = {k: run(lambda kw=kw: kept_logprobs(linear(h, w), ids, offsets, targets, **kw).sum(), [h, w])
               for k, kw in OP_METHODS.items() if k != "reference"}
        out["with_lm_head"] = measure(e2e, run(lambda: naive_loss(linear(h, w)), [h, w]), 7 * grad_bytes)
    return out


# ---------------------------------------------------------------------------------------------- main


def _print_mismatch(m: dict) -> None:
    ks = m["kept_size"]
    print(f"\n{m['model']} ({m['arch']}{', NVFP4 QAT' if m['nvfp4'] else ''}): {m['tokens']} tokens in "
          f"{m['trajectories']} trajectories, versions {m['versions']} (applied at {m['applied_at']} tokens per stream); "
          f"kept sets median {ks['median']:.0f}, p99 {ks['p99']:.0f}, {ks['single_pct']:.0f}% single")
    print(f"  {'row':<40} {'IS mean':>9} {'%out':>6} {'max|dlogp|':>11} {'KL k3':>9} {'KL k1':>10} {'routing dis':>11}")
    for r in m["rows"]:
        rd = "n/a" if r["routing_disagreement"] is None else f"{r['routing_disagreement']:.4f}"
        print(f"  {r['row']:<40} {r['is_mean']:9.5f} {r['outside_pct']:6.1f} {r['max_abs_dlogp']:11.2e} "
              f"{r['kl_k3']:9.2e} {r['kl_k1']:10.2e} {rd:>11}")
    parts = ", ".join(f"{k} {v['mean']:+.3e}" for k, v in m["sources"]["components"].items())
    print(f"  log-ratio by source (newest weights, no replay, against the engine): {parts}; total "
          f"{m['sources']['total']['mean']:+.3e}; lag {m['sources']['lag']['counts']}")


def _print_op(o: dict) -> None:
    print(f"\nkept_logprobs, T={o['rows']}, V={o['vocab']} ({o['kept_ids']} kept ids), fp32 logits; writing a [T, V] "
          f"gradient alone (zeros): {o['zeros_floor_s'] * 1e3:.1f} ms")
    parts = [("forward + backward into the logits", o["op"])]
    if "with_lm_head" in o:
        parts.append((f"with the lm_head, forward + backward through linear([T, {o['lm_head_hidden']}], [V, "
                      f"{o['lm_head_hidden']}])", o["with_lm_head"]))
    for title, res in parts:
        print(f"  {title}:")
        for name, r in res.items():
            if "skipped" in r:
                print(f"    {name:<17} not run: {r['skipped']}")
                continue
            extra = ""
            if "speedup" in r:
                mem, work = (("n/a" if v is None else f"{v:.1f}x") for v in (r["memory_ratio"], r["working_memory_ratio"]))
                extra = f"  {r['speedup']:6.1f}x faster, {mem} less peak ({work} not counting a [T, V] gradient)"
            print(f"    {name:<17} {r['s'] * 1e3:9.1f} ms  peak {r['peak_bytes'] / 2**20:8.1f} MiB{extra}")
    if "lm_head_s" in o:
        fr = ", ".join(f"{k} {100 * v:.2f}%" for k, v in o["lm_head_fraction"].items())
        print(f"  the lm_head forward matmul alone: {o['lm_head_s'] * 1e3:.1f} ms; the op as a share of it: {fr}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.replay", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="default")
    for k in ("requests", "max_tokens", "concurrency", "updates", "update_every", "pretrain_steps", "hidden", "vocab",
              "lm_hidden", "repeats", "synthetic", "speed_rounds", "speed_hidden", "speed_layers", "speed_pairs"):
        p.add_argument("--" + k.replace("_", "-"), type=int, default=None)
    p.add_argument("--rows", default=None, help="comma-separated T values for the op (default: the preset's)")
    p.add_argument("--tolerance", type=float, default=None,
                   help="kept-set tolerance the workers record with (default: the preset's, 1e-3)")
    p.add_argument("--models", default="dense,moe,nvfp4", help=f"mismatch-table models of {', '.join(MODELS)} ('' none)")
    p.add_argument("--mem-budget-gib", type=float, default=None,
                   help="memory the op benchmark may use (default: 70%% of MemAvailable)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine", choices=("reference", "vllm"), default="reference",
                   help="vllm: only the engines' mismatch table, vLLM beside the reference engine on the same streams "
                        "and updates, with vLLM's recording cost (bench/_replay_engines.py; dense and moe)")
    output_flags(p, "replay")
    return p


def rows(results: dict) -> list[Row]:
    """The shared columns: every kept_logprobs method (forward + backward) at every T against the naive masked
    log-softmax ('-' where the naive one did not fit the memory budget)."""
    out = []
    for o in results["op"]:
        for part, what in (("op", ""), ("with_lm_head", " + lm_head")):
            for name, r in o.get(part, {}).items():
                if name != "naive" and "s" in r:
                    out.append(Row(f"kept_logprobs {name}{what}", r["s"], r.get("speedup"),
                                   "naive masked log-softmax", f"T={o['rows']} V={o['vocab']}"))
    return out


def _available() -> int:
    fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return int(fields["MemAvailable"].split()[0]) * 1024


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.engine == "vllm":
        from bench._replay_engines import main_with

        return main_with(args, models_given=args.models != parser().get_default("models"))
    cfg = dict(PRESETS[args.preset])
    cfg.update({k: v for k, v in vars(args).items() if k in cfg and v is not None})
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        print(f"bench.replay: --models: unknown {unknown} (choose from {', '.join(MODELS)})", file=sys.stderr)
        return 2
    budget = int((args.mem_budget_gib * 2**30) if args.mem_budget_gib else 0.7 * _available())
    print(f"syncd replay benchmark: preset {args.preset}, torch threads {torch.get_num_threads()}, "
          f"{platform.processor() or platform.machine()}, memory budget {budget / 2**30:.1f} GiB")
    results = {"bench": "replay", "preset": args.preset, "config": cfg, "public": PUBLIC, "mismatch": [], "op": []}
    with tempfile.TemporaryDirectory(prefix="bench-replay-") as tmp:
        for name in models:
            m = mismatch(name, cfg, Path(tmp))
            results["mismatch"].append(m)
            _print_mismatch(m)
    for T in (int(t) for t in str(cfg["rows"]).split(",")):
        o = op_bench(T, cfg["vocab"], cfg["lm_hidden"], cfg["repeats"], args.seed, budget)
        results["op"].append(o)
        _print_op(o)
    T0 = int(str(cfg["rows"]).split(",")[0])
    pk = public_kept(cfg["synthetic"], 151936, args.seed, (cfg["tolerance"], 1e-2, 1e-1), op_rows=T0,
                     repeats=cfg["repeats"])
    lm = next((o["lm_head_s"] for o in results["op"] if o["rows"] == T0 and o["vocab"] == 151936 and "lm_head_s" in o),
              None)
    pk["op"]["rebuild_vs_lm_head"] = None if lm is None else pk["op"]["rebuild_s"] / lm
    results["bytes"] = {"public": pk, "routes": route_bytes(),
                        "recorded": {m["model"]: m["bytes"] for m in results["mismatch"]}}
    print_bytes(results, cfg["tolerance"])
    results.update(python=sys.version.split()[0], torch=torch.__version__, machine=platform.machine(),
                   cpus=os.cpu_count())
    return finish("replay", args, results, rows(results), lambda path: plot(results, path))


def plot(results: dict, path: Path) -> None:
    from bench._plot import pyplot, save

    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(19, 4.5))
    ax = axes[0]
    labels, values = [], []
    for m in results["mismatch"]:
        for r in m["rows"]:
            labels.append(f"{m['model']}: {r['row']}")
            values.append(max(r["max_abs_dlogp"], 1e-8))
    ax.barh(labels, values, color="tab:blue")
    ax.set_xscale("log")
    ax.axvline(1e-4, color="tab:red", ls="--", label="target 1e-4")
    ax.set_xlabel("max |log p_trainer - log p_engine|")
    ax.legend(fontsize=8)
    ax.tick_params(axis="y", labelsize=7)
    ax = axes[1]
    for o in results["op"]:
        names = [n for n, r in o["op"].items() if "s" in r]
        ax.bar([f"{n}\nT={o['rows']}" for n in names], [o["op"][n]["s"] * 1e3 for n in names])
    ax.set_yscale("log")
    ax.set_ylabel("forward + backward, ms")
    ax.set_title("kept_logprobs vs the naive masked log-softmax")
    ax = axes[2]
    pk = results["bytes"]["public"]
    bars = {"int32 ids": pk["int32_ids_per_token"], "format 1 (listed)": pk["listed_v1_per_token"],
            "bound of a listing": pk["listed_bound_per_token"]}
    bars.update({f"format 2, tol {float(d):g}": r["per_token"] for d, r in pk["by_tolerance"].items()})
    ax.bar(list(bars), list(bars.values()), color=["tab:gray"] * 3 + ["tab:green"] * len(pk["by_tolerance"]))
    ax.axhline(8, color="tab:red", ls="--", label="goal 8 B")
    ax.axhline(PUBLIC["prime_rl_bytes_per_token"], color="tab:orange", ls=":", label="prime-rl about 32 B")
    ax.set_ylabel("kept-set bytes per token")
    ax.set_title(f"kept sets at V={pk['vocab']:,} (synthetic, public size distribution)")
    ax.tick_params(axis="x", labelsize=7, rotation=20)
    ax.legend(fontsize=8)
    save(fig, path)


if __name__ == "__main__":
    sys.exit(main())
