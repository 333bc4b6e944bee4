"""``python -m bench.replay --engine vllm``: vLLM and the reference engine side by side on replay, in one run.

For each model (a tiny dense Qwen2 and a tiny Qwen3-MoE with head_dim 64, the size vLLM's CPU attention takes;
trained for a few real AdamW steps on text so that their distributions are peaked), versions 1 and 2 are two more
real steps. Each engine serves the same ``requests`` sampled streams (temperature 1, top-p, top-k) recording
replay records, and takes version k in place (stage, pause, apply, resume) once every stream made ``k *
update_every`` tokens. The trainer then recomputes each token's log-prob under the weights its engine used
(segmented: every position on the version that ran it, over the keys and values of the earlier segments, as the
engines' kept caches hold them) in three replay modes:

=========  ===================================================================================================
``none``   the full-vocabulary softmax at the temperature, the model's own routers
``kept``   the recorded kept set (``syncd.ops.replay.kept_logprobs``), the model's own routers
``full``   the recorded kept set and the recorded routes (``syncd.trainer.rl.replay.routing_replay``)
=========  ===================================================================================================

One row per (engine, model, mode): ``is_mean`` (mean of ``exp(lp_trainer - lp_engine)``), ``is_outside_frac``
(share outside [0.9, 1.1]), ``max_abs_dlogp``, ``routing_disagreement`` (MoE: share of (position, layer) routes the
trainer's forward used, as its experts received them, that differ from the engine's), ``kept_mass_gap`` (mean of
1 - the mass of the engine's kept set under the trainer's full distribution). With the kept sets and routes
replayed and the versions exact, what remains of the mismatch is the numerics of each engine's kernels against the
trainer's (the reference engine computes with transformers' own modules, vLLM with its CPU kernels).

Also per model: vLLM's generation tokens/s with recording on against off (the same engine and streams, no updates,
``speed_rounds`` pairs of rounds, the median of the pairs' ratios), and the bytes per token of the records. The
tiny models' decode step is about 3 ms on two CPU cores, most of it Python, so recording's fixed cost per step
(the processor ranks and masks every row, the tap reads the step) weighs more there than at any real size: the
same measurement also runs on a larger dense model (``speed_hidden``, ``speed_layers``; default about 90M
parameters), the ``speed`` row.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["PRESETS", "run", "main_with"]

PRESETS = {"default": dict(requests=8, max_tokens=512, updates=2, update_every=160, pretrain_steps=60, speed_rounds=6,
                           speed_hidden=1024, speed_layers=8, speed_pairs=4),
           "tiny": dict(requests=2, max_tokens=24, updates=1, update_every=8, pretrain_steps=4, speed_rounds=2,
                        speed_hidden=128, speed_layers=1, speed_pairs=1)}
MODELS = {"dense": "qwen2", "moe": "qwen3_moe"}
SIZES = dict(hidden=128, heads=2, kv_heads=1, intermediate=256, layers=2, experts=8, top_k=2)
SAMPLING = dict(temperature=1.0, top_p=0.8, top_k=20)
MODES = ("none", "kept", "full")


@dataclass
class Trained:
    """A trained tiny model: its folder (version 0), each version's served weights (float32 of the bf16 words),
    each later version as an in-memory Update, and the transformers config."""

    folder: Path
    weights: dict
    updates: dict
    config: object

    def model(self, version: int):
        from syncd.engine.reference.make_tiny import random_model

        m = random_model(self.config, 0)
        m.load_state_dict(self.weights[version])
        return m.eval()


def _train(arch: str, cfg: dict, root: Path) -> Trained:
    """Pretrain, publish version 0 (the folder) and ``updates`` more real steps (``bench.rollouts``' helpers)."""
    from bench.rollouts import RolloutConfig, _pretrained, _published, _served, _write_folder, train_step
    from syncd.engine.reference.make_tiny import model_config
    from syncd.engines.update import Update
    from syncd.trainer import WeightPublisher
    from syncd.versions import fetch_shards, read_manifest

    s = SIZES
    mcfg = model_config(arch, hidden=s["hidden"], layers=s["layers"], heads=s["heads"], kv_heads=s["kv_heads"],
                        intermediate=s["intermediate"], experts=s["experts"], top_k=s["top_k"])
    model, opt, data, gen = _pretrained(RolloutConfig(arch=arch, pretrain_steps=cfg["pretrain_steps"]), mcfg)
    folder = _write_folder(root / "model", mcfg, model, _published(model, False))
    store = (root / "versions").resolve().as_uri()
    weights, updates = {0: _served(model)}, {}
    with WeightPublisher(store, "bench", signing_key=False, full_every=1000) as pub:
        pub.publish(_published(model, False), 0)
        for v in range(1, cfg["updates"] + 1):
            train_step(model, opt, data, gen)
            pub.publish(_published(model, False), v)
            pub.flush()
            weights[v] = _served(model)
            m = read_manifest(store, "bench", v)
            updates[v] = Update.from_shards(m, fetch_shards(store, "bench", m))
    return Trained(folder, weights, updates, mcfg)


def _requests(cfg: dict, prefix: str):
    from syncd.engines.protocol import GenerationRequest, SamplingParams

    return [GenerationRequest(f"{prefix}-{k}", tuple((17 * k + 5 * j) % 250 + 1 for j in range(12 + k)),
                              SamplingParams(max_tokens=cfg["max_tokens"], seed=1000 + k, **SAMPLING))
            for k in range(cfg["requests"])]


def _serve(engine, reqs, updates: dict, every: int) -> tuple[list, float]:
    """Every request's events, streamed at once; version k staged while serving and applied (pause, apply,
    resume) once every stream made ``k * every`` tokens. Returns the events and the wall seconds."""
    progress = [0] * len(reqs)

    async def stream(k, req):
        evs = []
        async for ev in engine.generate(req):
            evs.append(ev)
            progress[k] += 1
        return evs

    async def control(tasks):
        for v in sorted(updates):
            await asyncio.to_thread(engine.stage, updates[v])
            while min(progress) < v * every and not all(t.done() for t in tasks):
                await asyncio.sleep(0.002)
            for op in (engine.pause, engine.apply, engine.resume):
                await asyncio.to_thread(op)

    async def main():
        tasks = [asyncio.ensure_future(stream(k, r)) for k, r in enumerate(reqs)]
        await control(tasks)
        return await asyncio.gather(*tasks)

    t0 = time.perf_counter()
    out = asyncio.run(main())
    return out, time.perf_counter() - t0


def _start(kind: str, trained: Trained, store: Path, run_id: str, cfg: dict):
    """``kind``'s engine on version 0, recording into ``store`` under ``run_id``."""
    if kind == "vllm":
        from syncd.engine.vllm import ReplayConfig, VLLMEngine

        return VLLMEngine(trained.folder, version=0, max_model_len=cfg["max_tokens"] + 64, max_num_seqs=cfg["requests"],
                          replay=ReplayConfig(str(store), run_id))
    from syncd.engine.reference import ReferenceEngine
    from syncd.engine.replay import ReplayRecorder

    return ReferenceEngine.from_pretrained(trained.folder, version=0, max_batch=cfg["requests"],
                                           recorder=ReplayRecorder(str(store), run_id))


def _flush(engine) -> None:
    rec = engine.recorder
    if rec is not None:
        rec.flush(120)


# ---------------------------------------------------------------------------------------------- the trainer side


def _segments(P: int, versions: list) -> list[tuple[int, int, int]]:
    """``(start, end, version)`` runs of the positions ``0 .. P+n-2`` by the version that ran them: the prompt but
    its last position with the first token's, position ``P+i-1`` with token i's."""
    rows = [versions[0]] * (P - 1) + list(versions)
    out, a = [], 0
    for q in range(1, len(rows) + 1):
        if q == len(rows) or rows[q] != rows[a]:
            out.append((a, q, rows[a]))
            a = q
    return out


def _forward(models, seq, segments, routes, replay: bool):
    """Logits of positions ``0 .. T-2`` of ``seq`` segment by segment (each on its version's model, over the
    earlier segments' cache), under the recorded ``routes`` when ``replay``; and the routes each forward's experts
    received (MoE)."""
    from syncd.trainer.rl.replay import routing_replay

    cache, logits, used = None, [], []
    for a, b, v in segments:
        model = models[v]
        experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
        seen: list = []
        hooks = [e.register_forward_pre_hook(lambda m, arg, i=i: seen.append((i, arg[1])))
                 for i, e in enumerate(experts)]
        try:
            with torch.no_grad():
                if replay and routes is not None:
                    with routing_replay(model, torch.as_tensor(routes[a:b])):
                        out = model(seq[:, a:b], past_key_values=cache, use_cache=True)
                else:
                    out = model(seq[:, a:b], past_key_values=cache, use_cache=True)
        finally:
            for h in hooks:
                h.remove()
        cache = out.past_key_values
        logits.append(out.logits[0].float())
        if experts:
            per_layer = [torch.cat([x for i, x in seen if i == layer]) for layer in range(len(experts))]
            used.append(torch.stack(per_layer, 1))
    return torch.cat(logits), (torch.cat(used) if used else None)


def _token_rows(models, req, recs, chunks) -> dict:
    """Per replay mode: the trainer's log-probs of the request's tokens, the kept-set mass gaps, and the route
    disagreements counted (differing, total)."""
    import numpy as np

    from syncd.ops.replay import kept_logprobs

    P, T = len(req.prompt_token_ids), req.sampling.temperature
    toks = [r.token_id for r in recs]
    seq = torch.tensor([list(req.prompt_token_ids) + toks])
    routes = None
    if chunks[0].prompt_routing is not None:
        routes = np.concatenate([chunks[0].prompt_routing, np.stack([r.routing for r in recs])])
    segs = _segments(P, [r.version for r in recs])
    ids = [torch.as_tensor(np.asarray(r.kept), dtype=torch.int64) for r in recs]
    offsets = torch.tensor([0] + [len(i) for i in ids]).cumsum(0)
    flat, target = torch.cat(ids), torch.tensor(toks)
    out = {}
    for mode in MODES:
        if mode == "full" and routes is None:
            out[mode] = out["kept"]
            continue
        logits, used = _forward(models, seq, segs, routes, replay=mode == "full")
        z = logits[P - 1:]
        full = torch.log_softmax(z / T, -1)
        lp = full[torch.arange(len(toks)), target] if mode == "none" else kept_logprobs(z, flat, offsets, target, T)
        rows = torch.repeat_interleave(torch.arange(len(toks)), offsets[1:] - offsets[:-1])
        mass = torch.zeros(len(toks)).index_add_(0, rows, full.exp()[rows, flat])
        differ = total = 0
        if used is not None:
            rec = torch.as_tensor(routes).sort(-1).values
            differ = int((used.sort(-1).values != rec).any(-1).sum())
            total = rec.shape[0] * rec.shape[1]
        out[mode] = (lp.detach(), 1 - mass, differ, total)
    return out


def _mismatch(kind: str, name: str, trained: Trained, reqs, events, store: Path, run_id: str) -> list[dict]:
    from syncd.records.replay_store import read_request

    models = {v: trained.model(v) for v in trained.weights}
    acc = {m: {"lp": [], "engine": [], "gap": [], "differ": 0, "total": 0} for m in MODES}
    for req, evs in zip(reqs, events):
        chunks = read_request(str(store), run_id, req.request_id)
        recs = [r for c in chunks for r in c.records]
        if [r.token_id for r in recs] != [e.token_id for e in evs]:
            raise RuntimeError(f"{kind} {name} {req.request_id}: the records do not hold the streamed tokens")
        for mode, (lp, gap, differ, total) in _token_rows(models, req, recs, chunks).items():
            a = acc[mode]
            a["lp"].append(lp)
            a["engine"].append(torch.tensor([r.logprob for r in recs]))
            a["gap"].append(gap)
            a["differ"] += differ
            a["total"] += total
    rows = []
    for mode, a in acc.items():
        d = torch.cat(a["lp"]).double() - torch.cat(a["engine"]).double()
        ratio = d.exp()
        rows.append({"engine": kind, "model": name, "replay": mode, "tokens": int(d.numel()),
                     "is_mean": float(ratio.mean()),
                     "is_outside_frac": float(((ratio < 0.9) | (ratio > 1.1)).double().mean()),
                     "max_abs_dlogp": float(d.abs().max()),
                     "routing_disagreement": a["differ"] / a["total"] if a["total"] else None,
                     "kept_mass_gap": float(torch.cat(a["gap"]).double().mean())})
    return rows


def _bytes(store: Path, run_id: str, reqs, tokens: int) -> dict:
    """The records of ``reqs``: bytes, chunks, bytes per token."""
    from syncd.records.replay_store import replay_prefix, request_key
    from syncd.store import Store

    st = Store.open(str(store))
    objs = [o for r in reqs for o in st.list(f"{replay_prefix(run_id)}{request_key(r.request_id)}/")]
    total = sum(o.size for o in objs)
    return {"bytes": total, "chunks": len(objs), "bytes_per_token": total / max(tokens, 1)}


# ---------------------------------------------------------------------------------------------- one model


def _throughput(eng, cfg: dict, rounds: int) -> dict:
    """vLLM's generation tokens/s with recording on against off on the same recording engine, the same streams (no
    updates), after a warm-up: ``rounds`` pairs, each one round off and one on, in the order off-on, on-off, ...
    (a drift in the machine's load then favours neither). A request without replay is vLLM's own sampling (no
    processor, no records), so the difference is what recording costs. ``ratio``: the median over the pairs of
    on/off tokens/s (each pair ran side by side); ``tokens_per_s``: medians of the rounds."""
    import statistics

    async def streams(reqs, replay):
        async def one(r):
            return [e async for e in eng.generate(r, replay=replay)]
        return await asyncio.gather(*[one(r) for r in reqs])

    asyncio.run(streams(_requests(dict(cfg, max_tokens=16), "warm"), True))
    rates = {"off": [], "on": []}
    tokens = {}
    for k in range(rounds):
        for label in (("off", "on") if k % 2 == 0 else ("on", "off")):
            t0 = time.perf_counter()
            events = asyncio.run(streams(_requests(cfg, f"speed-{label}{k}"), label == "on"))
            tokens[label] = sum(len(e) for e in events)
            rates[label].append(tokens[label] / (time.perf_counter() - t0))
    out = {label: {"tokens": tokens[label], "tokens_per_s": statistics.median(r), "rounds": r}
           for label, r in rates.items()}
    out["pair_ratios"] = [on / off for on, off in zip(rates["on"], rates["off"])]
    out["ratio"] = statistics.median(out["pair_ratios"])
    w = eng.flush_replay()  # the worker's own account: seconds in the processor and the tap, per sampling step
    out["worker"] = dict(w, processor_ms_per_step=1e3 * w["processor_s"] / max(w["processor_calls"], 1),
                         record_ms_per_step=1e3 * w["record_s"] / max(w["processor_calls"], 1))
    return out


def model_rows(name: str, cfg: dict, root: Path) -> dict:
    """Every row of one model: both engines' mismatch rows, vLLM's recording cost, the records' bytes."""
    trained = _train(MODELS[name], cfg, root / name)
    store = root / name / "replay"
    result = {"model": name, "rows": [], "bytes": {}, "serve_s": {}}
    for kind in ("vllm", "reference"):
        run_id = f"{kind}-{name}"
        reqs = _requests(cfg, run_id)
        eng = _start(kind, trained, store, run_id, cfg)
        try:
            if kind == "vllm":
                result["recording"] = _throughput(eng, cfg, cfg["speed_rounds"])
            events, wall = _serve(eng, reqs, trained.updates, cfg["update_every"])
            _flush(eng)
        finally:
            eng.close()
        result["serve_s"][kind] = wall
        result["rows"] += _mismatch(kind, name, trained, reqs, events, store, run_id)
        result["bytes"][kind] = _bytes(store, run_id, reqs, sum(len(e) for e in events))
    return result


def speed_row(cfg: dict, root: Path) -> dict:
    """Recording's cost at a model whose decode step is not mostly Python: a dense Qwen2 of ``speed_hidden`` and
    ``speed_layers`` (head_dim 64, random weights: the rate does not depend on them), the same streams and
    sampling as the tiny models', ``speed_pairs`` pairs of rounds (:func:`_throughput`)."""
    from bench._report import model_params
    from syncd.engine.reference.make_tiny import write_model
    from syncd.engine.vllm import ReplayConfig, VLLMEngine

    h = cfg["speed_hidden"]
    folder = write_model(root / "speed" / "model", arch="qwen2", seed=3, hidden=h, heads=h // 64,
                         kv_heads=max(1, h // 256), intermediate=h * 11 // 4, layers=cfg["speed_layers"],
                         max_positions=cfg["max_tokens"] + 128)
    params = model_params(folder)
    eng = VLLMEngine(folder, version=0, max_model_len=cfg["max_tokens"] + 64, max_num_seqs=cfg["requests"],
                     replay=ReplayConfig(str(root / "speed" / "replay"), "speed"))
    try:
        rec = _throughput(eng, cfg, cfg["speed_pairs"])
    finally:
        eng.close()
    return {"model": f"dense {params / 1e6:.3g}M", "params": params, "hidden": h, "layers": cfg["speed_layers"],
            "recording": rec}


def run(cfg: dict, models: list[str]) -> dict:
    """The whole comparison (module docstring) for ``models`` (keys of :data:`MODELS`), and :func:`speed_row`."""
    with tempfile.TemporaryDirectory(prefix="bench-replay-vllm-") as tmp:
        return {"bench": "replay", "engine": "vllm", "config": cfg, "sampling": SAMPLING, "sizes": SIZES,
                "models": [model_rows(m, cfg, Path(tmp)) for m in models], "speed": speed_row(cfg, Path(tmp))}


def print_rows(results: dict) -> None:
    print(f"{'engine':<10} {'model':<6} {'replay':<6} {'tokens':>6} {'is_mean':>9} {'outside':>8} {'max|dlogp|':>11} "
          f"{'routing':>8} {'kept gap':>9}")
    for m in results["models"]:
        for r in m["rows"]:
            rd = "-" if r["routing_disagreement"] is None else f"{r['routing_disagreement']:.4f}"
            print(f"{r['engine']:<10} {r['model']:<6} {r['replay']:<6} {r['tokens']:>6} {r['is_mean']:>9.5f} "
                  f"{r['is_outside_frac']:>8.4f} {r['max_abs_dlogp']:>11.3e} {rd:>8} {r['kept_mass_gap']:>9.4f}")
        print(f"  {m['model']}: {_recording_text(m['recording'])}; bytes per token: "
              + ", ".join(f"{k} {b['bytes_per_token']:.1f}" for k, b in m["bytes"].items()))
    sp = results["speed"]
    print(f"  {sp['model']} (hidden {sp['hidden']}, {sp['layers']} layers): {_recording_text(sp['recording'])}")


def _recording_text(r: dict) -> str:
    return (f"vLLM {r['off']['tokens_per_s']:.1f} tokens/s with recording off, {r['on']['tokens_per_s']:.1f} with "
            f"(median of {len(r['pair_ratios'])} paired ratios {r['ratio']:.3f}; the processor "
            f"{r['worker']['processor_ms_per_step']:.2f} ms and the tap {r['worker']['record_ms_per_step']:.2f} ms "
            "per step)")


def main_with(args, *, models_given: bool) -> int:
    """``bench.replay``'s main for ``--engine vllm``: ``--preset`` (its sizes here), the load flags it shares,
    ``--models`` (of :data:`MODELS`; default both), ``--json``/``--plot``."""
    from bench._report import Row, finish

    cfg = dict(PRESETS[args.preset])
    cfg.update({k: v for k, v in vars(args).items() if k in cfg and v is not None})
    models = [m for m in args.models.split(",") if m] if models_given else list(MODELS)
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        print(f"bench.replay --engine vllm: --models: unknown {unknown} (choose from {', '.join(MODELS)})")
        return 2
    results = run(cfg, models)
    print_rows(results)
    table = [Row(f"{r['engine']} {r['model']} replay={r['replay']}", None, r["is_mean"], "IS ratio mean (1: none)",
                 f"{r['tokens']} tokens") for m in results["models"] for r in m["rows"]]
    table += [Row(f"vllm {m['model']} recording on", None, m["recording"]["ratio"],
                  "recording off (tokens/s)", f"{m['recording']['on']['tokens']} tokens")
              for m in results["models"] + [results["speed"]]]
    return finish("replay", args, results, table, lambda path: plot(results, path))


def plot(results: dict, path: Path) -> None:
    """Each row's max |d log p| (log scale)."""
    from bench._plot import pyplot, save

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    rows = [r for m in results["models"] for r in m["rows"]]
    ax.barh([f"{r['engine']} {r['model']} {r['replay']}" for r in rows], [max(r["max_abs_dlogp"], 1e-8) for r in rows])
    ax.set_xscale("log")
    ax.set_xlabel("max |log p_trainer - log p_engine|")
    save(fig, path)
