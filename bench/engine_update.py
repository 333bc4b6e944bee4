"""Engine update benchmark: the reference engine serves a steady load while real deltas are applied in place.

A Qwen2-style model (random init, fp32 master weights) takes AdamW steps on a policy-gradient loss at an RL
learning rate (``bench.codec.snapshots``); ``syncd.trainer.WeightPublisher`` publishes version 0 (full) and one
delta per step to a local file store. ``ReferenceEngine.from_store`` loads version 0, client threads keep
``clients`` requests running, and the controller reads each version back (``syncd.versions``), stages it
while serving, then pauses, applies and resumes, and verifies the checksums after resuming. Measured in the
same run:

* the stall per update: from ``pause()`` returning (no forward pass running) to ``resume()`` returning,
  i.e. the in-place apply, median and max; next to a full-weight reload of the same model
  (``model.load_state_dict`` of the version's bf16 tensors into an fp32 model of the same config, what a
  reloading engine would do) and the engine's own ``load_full``;
* the physical limit of the ratio, in memory traffic: an in-place apply must move at least the cache lines
  that hold a changed word (read and write back), a full reload reads the new weights and writes every line
  of the storage (each write first reads its line: write-allocate);
* staging without serving load against its baseline, a decode of the update's change lists (``delta.changes``,
  what any stage must do): the engine checks base and result checksums on top (a read pass of the weights and the
  changed words), and a ratio near 1 says it decodes each blob once;
* tokens/s without updates and while updates are applied, and requests lost (must be 0).

``--device cuda`` (``auto``: cuda when available) serves from the GPU (weights in the engine's GPU dtype).
Every stall, apply and reload time then waits for the device (``torch.cuda.synchronize``) before its clock
stops, so asynchronous launches hide nothing. The full reload is what a reloading GPU engine does, from host
memory over PCIe: ``load_state_dict`` of the CPU tensors into the model on the GPU (the baseline of the
ratio), also from pinned host memory, and, as a lower bound no reloading engine gets, from tensors already on
the GPU. The physical limit there comes from copy rates measured in the same run (``bench._gpu_reload``): a
reload moves every byte over PCIe, an apply moves the staged delta over PCIe and rewrites the touched lines
in device memory. ``--device cuda`` without CUDA is an error (exit status 2), never a CPU run.

Writes JSON (``--json``); ``--plot`` draws each pause against the full reloads.

    python -m bench.engine_update                  # ~110M parameters, lr 1e-6, 5 updates
    python -m bench.engine_update --preset tiny    # seconds; what the test runs
    python -m bench.engine_update --device cuda --updates 5 --window 10   # on a GPU machine
    python -m bench.engine_update --engine vllm [--preset tiny]           # a real vLLM (bench.engine_update_vllm)
"""

from __future__ import annotations

import argparse
import logging
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench._engine_load import LINE, Load, qwen2_config, tokens_during, touched_lines
from bench._report import Row, finish, output_flags
from bench._timing import Stopwatch, median
from bench import _gpu_reload as gpu

log = logging.getLogger("bench.engine_update")

PRESETS = {
    "default": dict(hidden=768, layers=12, heads=12, kv_heads=4, intermediate=2048, vocab=16000, batch=2, seq=64,
                    warmup=2, updates=5, clients=4, prompt=16, max_tokens=24, window=20.0, interval=3.0,
                    reload_repeats=5),
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=512, batch=2, seq=16,
                 warmup=1, updates=3, clients=2, prompt=8, max_tokens=6, window=1.0, interval=0.2,
                 reload_repeats=2),
}
def publish_versions(cfg: dict, lr: float, seed: int, store, delta_format: int) -> list[dict]:
    """Step 1: the trainer side. ``cfg["updates"]`` AdamW steps (``bench.codec.snapshots``) published to ``store``
    as run "bench" (version 0 full, one delta per step); returns the bf16 snapshots (trainer names)."""
    from bench.codec import snapshots
    from syncd.trainer import WeightPublisher

    sw = Stopwatch()
    snaps = snapshots(cfg, lr, cfg["updates"], seed)
    nparams = sum(t.numel() for t in snaps[0].values())
    print(f"{nparams / 1e6:.1f}M parameters, {cfg['warmup'] + cfg['updates']} AdamW steps (lr {lr:g}) in "
          f"{sw.lap():.1f}s")
    with WeightPublisher(store, "bench", signing_key=False, full_every=10**6, delta_format=delta_format) as pub:
        for step, snap in enumerate(snaps):
            pub.publish(snap, step)
    print(f"published 1 full + {cfg['updates']} delta versions in {sw.lap():.1f}s")
    return snaps


def _read_update(store, version: int):
    from syncd.engines.update import Update
    from syncd.versions import fetch_shards, read_manifest

    m = read_manifest(store, "bench", version, signing_key=False)
    return m, Update.from_shards(m, fetch_shards(store, "bench", m))


def update_while_serving(engine, store, version: int, sync, cuda: bool) -> dict:
    """Step 2, one version: stage it while serving, pause, apply, resume, verify the checksums after resuming
    (RuntimeError if they differ from the manifest's); the seconds of each part and the staged delta's size."""
    m, update = _read_update(store, version)
    sw = Stopwatch()
    engine.stage(update)
    stage_s = sw.lap()
    engine.pause()
    sync()  # the last step's device work belongs to the pause wait, not to the stall
    pause_wait_s = sw.lap()
    engine.apply()
    sync()  # the scatter is launched asynchronously: the stall ends when it has run
    apply_s = sw.lap()
    engine.resume()
    stall_s = apply_s + sw.lap()
    got = engine.checksum()
    verify_s = sw.lap()
    if got != {t.name: t.checksum for t in m.tensors}:
        raise RuntimeError(f"version {version}: engine checksums differ from the manifest's after apply")
    staged = engine.updater.last_applied
    row = dict(version=version, stage_s=stage_s, pause_wait_s=pause_wait_s, apply_s=apply_s, stall_s=stall_s,
               verify_s=verify_s, changed=staged.changed, staged_bytes=staged.nbytes,
               lines=touched_lines(engine.updater, staged))
    if cuda:  # what apply copies host -> device: positions and new words (old ones by fingerprint)
        row["h2d_bytes"] = sum(p.index.nbytes + p.new.nbytes for p in staged.params)
    return row


def serve_and_update(engine, store, cfg: dict, seed: int, sync, cuda: bool) -> dict:
    """Step 2: client threads keep the engine busy; tokens/s over ``cfg["window"]`` without updates, then every
    version applied while serving (:func:`update_while_serving`) and tokens/s meanwhile; the requests' counts."""
    load = Load(engine, cfg, seed)
    updates = []
    try:
        load.start()
        while engine.stats.tokens == 0:  # warm: every client has produced tokens
            time.sleep(0.01)
        tokens_base, secs_base = tokens_during(engine, cfg["window"])
        phase, n_phase = Stopwatch(), engine.stats.tokens
        for v in range(1, cfg["updates"] + 1):
            time.sleep(cfg["interval"])
            updates.append(update_while_serving(engine, store, v, sync, cuda))
        tokens_upd, secs_upd = engine.stats.tokens - n_phase, phase.elapsed
    finally:
        load.finish()
    return dict(updates=updates, tokens_per_s_baseline=tokens_base / secs_base,
                tokens_per_s_with_updates=tokens_upd / secs_upd, requests_submitted=load.submitted,
                requests_completed=load.completed, requests_lost=load.submitted - load.completed,
                failures=load.failures[:10])


def quiet_rounds(engine, store, before_last: dict, cfg: dict, sync) -> dict:
    """Step 3: the last version's in-place apply without serving load, like the reloads: rollback, a decode of its
    change lists (``delta.changes``, the least any stage does; ``before_last``: the weights it applies to), stage,
    apply; seconds of each, ``cfg["reload_repeats"]`` rounds. The engine is left paused with that version."""
    from syncd.ops import delta

    engine.pause()
    sync()
    times = {"rollback": [], "decode": [], "stage": [], "apply": []}
    _, last_update = _read_update(store, cfg["updates"])
    for _ in range(cfg["reload_repeats"]):
        sw = Stopwatch()
        engine.rollback()
        sync()
        times["rollback"].append(sw.lap())
        for name, blob in last_update.tensors.items():
            delta.changes(blob, base=before_last[name])
        times["decode"].append(sw.lap())
        engine.stage(last_update)
        sync()
        times["stage"].append(sw.lap())
        engine.apply()
        sync()
        times["apply"].append(sw.lap())
    return times


def full_reloads(config, engine, snaps: list, cfg: dict, device: str) -> tuple[list[float], dict | None]:
    """Step 4: the baseline, full-weight reloads of the same model in the same run. On the CPU
    ``model.load_state_dict`` of each snapshot into an fp32 model; on CUDA into the model on the GPU in the engine's
    dtype, from host and device memory (``_gpu_reload.reload_baselines``, also returned). Seconds per reload."""
    from transformers import AutoModelForCausalLM

    if device == "cuda":
        model = AutoModelForCausalLM.from_config(config, dtype=engine.runner.compute_dtype)
        model = model.to(device).eval().requires_grad_(False)
        gpu_reload = gpu.reload_baselines(model, snaps, cfg["reload_repeats"], device)
        return list(gpu_reload["host_pageable_s"]), gpu_reload
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval().requires_grad_(False)
    reload = []
    for i in range(cfg["reload_repeats"]):
        sw = Stopwatch()
        model.load_state_dict(snaps[i % len(snaps)], strict=True)
        reload.append(sw.elapsed)
    return reload, None


def engine_load_full(engine, snaps: list, cfg: dict, sync) -> list[float]:
    """Step 5: the engine's own full reload (``load_full``), paused; seconds per call."""
    from syncd.engines.update import Update

    engine.pause()
    times = []
    for i in range(max(1, cfg["reload_repeats"] // 2)):
        upd = Update(100 + i, "full", snaps[(i + 1) % len(snaps)])
        sync()
        sw = Stopwatch()
        engine.load_full(upd)
        sync()
        times.append(sw.elapsed)
    return times


def run(cfg: dict, lr: float, seed: int, workdir: Path, verify_apply: bool = True, device: str = "cpu",
        delta_format: int = 1) -> dict:
    """The measurements described in the module docstring, on ``device`` ("cpu" or "cuda", already resolved
    by ``_gpu_reload.resolve_device``), in the steps above; returns the ``result`` dict of the JSON. Raises
    RuntimeError if the engine's checksums differ from a manifest's after an apply."""
    from syncd.engine.reference import ReferenceEngine
    from syncd.lazy import quiet_optional_imports
    from syncd.store import Store

    quiet_optional_imports()
    store = Store(workdir / "store")
    snaps = publish_versions(cfg, lr, seed, store, delta_format)
    config = qwen2_config(cfg)
    engine = ReferenceEngine.from_store(store, "bench", 0, config=config, signing_key=False,
                                        max_batch=cfg["clients"], verify_apply=verify_apply, device=device)
    sync = gpu.synchronizer(device)  # no-op on the CPU; on CUDA, no clock stops before the device is done
    served = serve_and_update(engine, store, cfg, seed, sync, device == "cuda")
    quiet = quiet_rounds(engine, store, snaps[cfg["updates"] - 1], cfg, sync)
    engine.resume()
    reload, gpu_reload = full_reloads(config, engine, snaps, cfg, device)
    load_full = engine_load_full(engine, snaps, cfg, sync)
    engine.close()
    storage_bytes = sum(t.numel() * t.element_size() for t in engine.runner.model.state_dict().values())
    return summarize(snaps, storage_bytes, served, quiet, reload, load_full, gpu_reload, lr=lr, device=device,
                     delta_format=delta_format)


def summarize(snaps: list, storage_bytes: int, served: dict, quiet: dict, reload: list, load_full: list,
              gpu_reload: dict | None, *, lr: float, device: str, delta_format: int) -> dict:
    """Step 6: the ``result`` dict from the steps' measurements, with the memory-traffic limit of the ratio: a full
    reload reads the bf16 source and writes every line of the storage, each write first reading its line
    (write-allocate: converting stores are not streaming); an in-place apply must at least read and write back
    each touched line. On CUDA the limit comes from copy rates measured now (``_gpu_reload.figures``)."""
    updates = served["updates"]
    nparams = sum(t.numel() for t in snaps[0].values())
    weight_bytes = sum(t.numel() * t.element_size() for t in snaps[0].values())
    med_lines = median([u["lines"] for u in updates])
    limit_ratio = (weight_bytes + 2 * storage_bytes) / (2 * med_lines * LINE) if med_lines else float("inf")
    stall = [u["stall_s"] for u in updates]
    extra = dict(device=device, gpu_name=gpu.gpu_name(device), physical_limit_basis="cpu cache lines")
    if gpu_reload is not None:
        extra.update(gpu.figures(gpu_reload, storage_bytes, weight_bytes, med_lines * LINE, updates, median(stall),
                                 median(quiet["apply"]), device))
        limit_ratio = extra.pop("physical_limit_ratio")
    return dict(
        params=nparams, weight_bytes=weight_bytes, storage_bytes=storage_bytes, lr=lr,
        density=median([u["changed"] / nparams for u in updates]),
        lines_touched_fraction=med_lines / (storage_bytes // LINE),
        updates=updates, stall_median_s=median(stall), stall_max_s=max(stall),
        apply_median_s=median([u["apply_s"] for u in updates]),
        pause_wait_median_s=median([u["pause_wait_s"] for u in updates]),
        stage_median_s=median([u["stage_s"] for u in updates]),
        verify_median_s=median([u["verify_s"] for u in updates]),
        reload_load_state_dict_median_s=median(reload), engine_load_full_median_s=median(load_full),
        ratio_reload_to_stall=median(reload) / median(stall), physical_limit_ratio=limit_ratio,
        quiet_apply_median_s=median(quiet["apply"]), quiet_rollback_median_s=median(quiet["rollback"]),
        quiet_stage_median_s=median(quiet["stage"]), decode_changes_median_s=median(quiet["decode"]),
        ratio_stage_to_decode=median(quiet["stage"]) / median(quiet["decode"]), delta_format=delta_format,
        reload_s=list(reload), load_full_s=list(load_full), quiet_apply_s=list(quiet["apply"]),
        ratio_reload_to_quiet_apply=median(reload) / median(quiet["apply"]),
        **{k: served[k] for k in ("tokens_per_s_baseline", "tokens_per_s_with_updates", "requests_submitted",
                                  "requests_completed", "requests_lost", "failures")},
        **extra,
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.engine_update", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="default")
    p.add_argument("--engine", choices=("reference", "vllm"), default="reference",
                   help="the engine updated: syncd's reference engine or a real vLLM (bench.engine_update_vllm; CPU)")
    p.add_argument("--vllm-cpu-gemm", choices=("onednn", "torch"), default="onednn",
                   help="--engine vllm: vLLM's packed oneDNN linear layers (rebuilt after each write) or F.linear")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--updates", type=int, help="delta versions to apply (preset default)")
    p.add_argument("--clients", type=int, help="concurrent requests kept running (preset default)")
    p.add_argument("--window", type=float, help="seconds of load measured without updates (preset default)")
    p.add_argument("--interval", type=float, help="seconds between updates (preset default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--delta-format", type=int, choices=(1, 2), default=1,
                   help="the publisher's delta format (the reference engine holds every tensor whole: both work)")
    p.add_argument("--device", choices=gpu.DEVICES, default="cpu",
                   help="where the engine serves: cpu (default), cuda (an error without CUDA), auto (cuda when "
                        "available)")
    p.add_argument("--no-verify-apply", action="store_true",
                   help="apply without comparing the staged old words (the checksum after resume still verifies)")
    output_flags(p, "engine_update")
    return p


def parse_args(argv):
    """The parsed command line, ``--device`` resolved (``_gpu_reload.resolve_device``; SystemExit 2 for cuda
    without CUDA)."""
    p = parser()
    args = p.parse_args(argv)
    try:
        args.device = gpu.resolve_device(args.device)
    except ValueError as exc:
        p.error(str(exc))  # exits with status 2 and the message on stderr
    return args


def rows(r: dict, engine: str = "reference") -> list[Row]:
    """The shared columns: the pause per update while serving and the apply alone, against the full reload of the
    same weights, and staging against a decode of the change lists. The reference engine's checksums are compared
    with the manifest's after every apply (a difference raises): refcheck ok."""
    sizes = f"{r['params'] / 1e6:.1f}M params {100 * r['density']:.2f}%"
    dev = r["device"]
    if engine == "vllm":
        return [Row("vllm in place: pause", r["pause_median_s"], r["ratio_reload_to_pause"],
                    "vLLM reload_weights (pause)", sizes, dev, True),
                Row("vllm in place: stall", r["stall_median_s"], r["ratio_reload_stall_to_stall"],
                    "vLLM reload_weights (stall)", sizes, dev, True)]
    return [Row("reference: pause while serving", r["stall_median_s"], r["ratio_reload_to_stall"],
                "full reload (load_state_dict)", sizes, dev, True),
            Row("reference: apply, no load", r["quiet_apply_median_s"], r["ratio_reload_to_quiet_apply"],
                "full reload (load_state_dict)", sizes, dev, True),
            Row(f"reference: stage, format {r['delta_format']}", r["quiet_stage_median_s"],
                1 / r["ratio_stage_to_decode"], "decode of the change lists", sizes, dev)]


def print_gpu_reloads(r: dict, ms) -> None:
    """The reload lines of the table for a CUDA run (``r``: ``run``'s result)."""
    gbs = lambda b: f"{b / 1e9:.1f} GB/s"  # noqa: E731
    print("full reload from host memory (what a reloading engine does), model.load_state_dict on the GPU:")
    print(f"  CPU tensors (pageable):                              median {ms(r['reload_load_state_dict_median_s'])}"
          f"   -> reload / stall = {r['ratio_reload_to_stall']:.1f}x (goal >= 20x; physical limit on this GPU "
          f"at this density {r['physical_limit_ratio']:.1f}x)")
    print(f"  CPU tensors, pinned:                                 median {ms(r['reload_host_pinned_median_s'])}"
          f"   -> reload / stall = {r['ratio_pinned_reload_to_stall']:.1f}x")
    print(f"full reload, engine.load_full (CPU tensors):           median {ms(r['engine_load_full_median_s'])}")
    print("lower bound, not a reload an engine gets: load_state_dict from tensors already on the GPU (device copy):")
    print(f"                                                       median {ms(r['reload_device_median_s'])}"
          f"   -> reload / stall = {r['ratio_device_reload_to_stall']:.1f}x (physical limit "
          f"{r['physical_limit_ratio_device_reload']:.1f}x)")
    print(f"copy rates measured now ({r['bandwidth_buffer_bytes'] >> 20} MiB): host->device pinned "
          f"{gbs(r['h2d_pinned_bytes_per_s'])}, pageable {gbs(r['h2d_pageable_bytes_per_s'])}, device->device "
          f"{gbs(r['device_copy_bytes_per_s'])} (bytes copied)")
    print(f"physical limit: reload >= {r['weight_bytes'] / 1e6:.1f} MB over PCIe = {ms(r['limit_reload_host_s'])}; "
          f"apply >= {r['delta_h2d_bytes_median'] / 1e6:.2f} MB delta over PCIe + "
          f"{r['touched_bytes_median'] / 1e6:.1f} MB of touched lines copied on the device = "
          f"{ms(r['limit_apply_s'])}  -> {r['physical_limit_ratio']:.1f}x (measured {r['ratio_reload_to_stall']:.1f}x)")


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if args.engine == "vllm":
        from bench import engine_update_vllm

        return engine_update_vllm.main_from_args(args)
    cfg = dict(PRESETS[args.preset])
    for k in ("updates", "clients", "window", "interval"):
        if getattr(args, k) is not None:
            cfg[k] = getattr(args, k)
    if cfg["updates"] < 1 or cfg["clients"] < 1:
        print("engine_update: --updates and --clients must be at least 1", file=sys.stderr)
        return 2
    print(f"syncd engine update benchmark: preset {args.preset}, torch threads {torch.get_num_threads()}, "
          f"{platform.processor() or platform.machine()}"
          + (f", serving on {gpu.gpu_name(args.device)}" if args.device == "cuda" else ""))
    with tempfile.TemporaryDirectory(prefix="syncd-engine-bench-") as tmp:
        r = run(cfg, args.lr, args.seed, Path(tmp), verify_apply=not args.no_verify_apply, device=args.device,
                delta_format=args.delta_format)
    r["verify_apply"] = not args.no_verify_apply
    report(r)
    out = {"bench": "engine_update", "preset": args.preset, "config": cfg, "python": sys.version.split()[0],
           "torch": torch.__version__, "device": args.device, "gpu": r["gpu_name"], "result": r}
    rc = finish("engine_update", args, out, rows(r), lambda path: plot(r, path, args.preset))
    return rc or (0 if r["requests_lost"] == 0 else 1)


def report(r: dict) -> None:
    """Print ``run``'s result ``r`` (a reference-engine run) as text."""
    ms = lambda s: f"{1e3 * s:8.2f} ms"  # noqa: E731
    print(f"\ndensity {100 * r['density']:.3f}% of {r['params'] / 1e6:.1f}M words per update; "
          f"{100 * r['lines_touched_fraction']:.1f}% of the engine's cache lines hold a changed word")
    print(f"stall per update (pause returned -> resume returned): median {ms(r['stall_median_s'])}, "
          f"max {ms(r['stall_max_s'])}  (apply {ms(r['apply_median_s'])})")
    if r["device"] == "cuda":
        print_gpu_reloads(r, ms)
    else:
        print(f"full reload, model.load_state_dict:                    median {ms(r['reload_load_state_dict_median_s'])}"
              f"   -> reload / stall = {r['ratio_reload_to_stall']:.1f}x (goal >= 20x; physical limit at this "
              f"density {r['physical_limit_ratio']:.1f}x)")
        print(f"full reload, engine.load_full:                         median {ms(r['engine_load_full_median_s'])}")
    print(f"without serving load: apply {ms(r['quiet_apply_median_s'])}, rollback {ms(r['quiet_rollback_median_s'])}"
          f"   -> reload / apply = {r['ratio_reload_to_quiet_apply']:.1f}x")
    print(f"stage without serving load (format {r['delta_format']}): {ms(r['quiet_stage_median_s'])} against a decode "
          f"of the update's change lists (delta.changes, what any stage must do) {ms(r['decode_changes_median_s'])}"
          f"   -> stage / decode = {r['ratio_stage_to_decode']:.2f}x")
    print(f"off the stall: stage while serving {ms(r['stage_median_s'])}, pause wait (one step) "
          f"{ms(r['pause_wait_median_s'])}, checksum verify after resume {ms(r['verify_median_s'])}")
    print(f"tokens/s: {r['tokens_per_s_baseline']:.1f} without updates, {r['tokens_per_s_with_updates']:.1f} while "
          f"updating (ratio {r['tokens_per_s_with_updates'] / r['tokens_per_s_baseline']:.2f})")
    print(f"requests: {r['requests_submitted']} submitted, {r['requests_completed']} completed, "
          f"{r['requests_lost']} lost")


def plot(r: dict, path, preset: str):
    """Every pause of an engine serving while it is updated, next to the full reloads of the same model (each
    sample a dot, the median a bar; log scale): what the in-place update saves."""
    from bench._plot import pyplot, save

    plt = pyplot()
    groups = [("pause per update\n(while serving)", [u["stall_s"] for u in r["updates"]]),
              ("apply alone\n(no load)", r["quiet_apply_s"]),
              ("full reload\nload_state_dict", r["reload_s"]), ("full reload\nengine.load_full", r["load_full_s"])]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (label, vals) in enumerate(groups):
        ms = [v * 1e3 for v in vals]
        ax.scatter([i] * len(ms), ms, color=f"C{i}", alpha=0.7, zorder=3)
        if ms:
            med = median(ms)
            ax.hlines(med, i - 0.3, i + 0.3, color=f"C{i}", lw=2.5)
            ax.annotate(f"{med:.1f} ms", (i + 0.32, med), va="center", fontsize=8)
    ax.set_xticks(range(len(groups)), [g[0] for g in groups], fontsize=8)
    ax.set_xlim(-0.5, len(groups) - 0.2)
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    ax.set(yscale="log", ylabel="milliseconds (log scale)", title=(
        f"engine update: {r['params'] / 1e6:.1f}M parameters, {100 * r['density']:.2f}% of the words changed "
        f"(lr {r['lr']:g}, preset {preset})\nfull reload / pause {r['ratio_reload_to_stall']:.1f}x; the memory "
        f"traffic allows {r['physical_limit_ratio']:.1f}x at this density"))
    ax.yaxis.set_major_locator(LogLocator(subs=(1, 2, 3, 5)))
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.title.set_fontsize(9)
    return save(fig, path)


if __name__ == "__main__":
    sys.exit(main())
