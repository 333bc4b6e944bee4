"""GPU halves of ``bench.engine_update``: device selection, honest timing of asynchronous CUDA work, the
full-reload baselines a GPU engine would pay, and the copy bandwidths that bound the pause/reload ratio.

On a GPU a reloading engine receives the new weights as CPU tensors and copies every byte over PCIe
(``load_state_dict`` of host tensors into the model on the device); an in-place update moves only the staged
delta (positions + words) over PCIe and scatters on the device, rewriting the memory lines that hold a
changed word. Every time measured here waits for the device (``torch.cuda.synchronize``) before its clock
stops; nothing here runs, or pretends to run, without a real CUDA device.
"""

from __future__ import annotations

import statistics
from typing import Callable, Mapping, Sequence

import torch

from bench._timing import Stopwatch, best_time

DEVICES = ("cpu", "cuda", "auto")
BW_MIN_BYTES = 64 << 20  # copies timed for the bandwidths: at least this large (latency negligible) ...
BW_MAX_BYTES = 1 << 30  # ... and at most this large


def resolve_device(name: str) -> str:
    """``"cpu"`` or ``"cuda"`` for ``name`` in :data:`DEVICES` (``"auto"``: cuda when
    ``torch.cuda.is_available()``, else cpu). Raises ValueError for ``"cuda"`` without a usable CUDA device
    (never falls back to the CPU) and for an unknown name."""
    if name not in DEVICES:
        raise ValueError(f"unknown device {name!r} (choose from {', '.join(DEVICES)})")
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        built = torch.version.cuda or "no CUDA (CPU-only build)"
        raise ValueError(f"--device cuda: CUDA is not available (torch.cuda.is_available() is False; torch "
                         f"{torch.__version__}, built with {built}); use --device cpu or auto")
    return name


def synchronizer(device: str) -> Callable[[], None]:
    """A function that returns once all queued work on ``device`` has finished: ``torch.cuda.synchronize``
    for cuda, a no-op for cpu (CPU work is done when the call that did it returns)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def gpu_name(device: str) -> str | None:
    """The CUDA device's name, None for cpu."""
    return torch.cuda.get_device_name(torch.device(device)) if torch.device(device).type == "cuda" else None


def copy_bandwidths(nbytes: int, device: str = "cuda", repeats: int = 5) -> dict:
    """Measured copy rates on ``device`` in bytes copied per second, best of ``repeats``, for a buffer of
    ``nbytes`` clamped to [64 MiB, 1 GiB]: ``h2d_pinned_bytes_per_s`` (pinned host -> device, the PCIe
    ceiling), ``h2d_pageable_bytes_per_s`` (ordinary host memory -> device) and ``device_copy_bytes_per_s``
    (device -> device; each byte is read once and written once, so the memory traffic is twice this).
    ``bandwidth_buffer_bytes``: the size used. Needs a CUDA device (RuntimeError from torch otherwise)."""
    n = max(BW_MIN_BYTES, min(int(nbytes), BW_MAX_BYTES))
    pageable = torch.ones(n, dtype=torch.uint8)
    pinned = pageable.pin_memory()
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    dev2 = torch.empty_like(dev)
    synced = dict(warmup=1, sync=torch.cuda.synchronize)  # each copy timed between two synchronisations
    out = dict(bandwidth_buffer_bytes=n,
               h2d_pinned_bytes_per_s=n / best_time(lambda: dev.copy_(pinned, non_blocking=True), repeats, **synced),
               h2d_pageable_bytes_per_s=n / best_time(lambda: dev.copy_(pageable), repeats, **synced),
               device_copy_bytes_per_s=n / best_time(lambda: dev2.copy_(dev), repeats, **synced))
    del pageable, pinned, dev, dev2
    torch.cuda.empty_cache()
    return out


def reload_baselines(model: torch.nn.Module, snaps: Sequence[Mapping[str, torch.Tensor]], repeats: int,
                     device: str = "cuda") -> dict:
    """Seconds per ``model.load_state_dict(sd, strict=True)`` into ``model`` (already on the CUDA ``device``)
    for ``sd = snaps[i % len(snaps)]``, ``i < repeats``, from three sources, each list timed between two
    ``torch.cuda.synchronize()`` after one untimed warm-up load: ``host_pageable_s`` (the CPU tensors as
    given: what a reloading engine does), ``host_pinned_s`` (the same tensors copied into pinned memory
    first, not timed) and ``device_s`` (the same tensors already on the device: a device-to-device copy, a
    lower bound no reloading engine gets, since its new weights arrive in host memory)."""
    used = [snaps[i % len(snaps)] for i in range(repeats)]

    def timed(sds) -> list[float]:
        model.load_state_dict(sds[-1], strict=True)  # warm-up: allocator, copy-engine set-up
        ts = []
        for sd in sds:
            torch.cuda.synchronize()
            t0 = Stopwatch()
            model.load_state_dict(sd, strict=True)
            torch.cuda.synchronize()
            ts.append(t0.elapsed)
        return ts

    out = dict(host_pageable_s=timed(used))
    pinned = [{k: v.pin_memory() for k, v in sd.items()} for sd in used]
    out["host_pinned_s"] = timed(pinned)
    del pinned
    on_device = [{k: v.to(device) for k, v in sd.items()} for sd in used]
    out["device_s"] = timed(on_device)
    del on_device
    torch.cuda.empty_cache()
    return out


def gpu_limit(*, reload_bytes: int, device_reload_bytes: int, delta_bytes: float, touched_bytes: float,
              bw: Mapping[str, float]) -> dict:
    """The ratio bounds the copy rates ``bw`` (from :func:`copy_bandwidths`) imply. A reload from host memory
    moves ``reload_bytes`` over PCIe: at least ``reload_bytes / h2d_pinned``. An in-place apply moves
    ``delta_bytes`` (staged positions + words) over PCIe and rewrites ``touched_bytes`` (the memory lines
    holding a changed word, each read and written, i.e. copied): at least ``delta_bytes / h2d_pinned +
    touched_bytes / device_copy``. A device-to-device reload copies ``device_reload_bytes``: at least
    ``device_reload_bytes / device_copy``. Returns those seconds and the ratios ``reload bound / apply bound``
    (``physical_limit_ratio``, against the reload from host memory) and ``physical_limit_ratio_device_reload``."""
    h2d, d2d = bw["h2d_pinned_bytes_per_s"], bw["device_copy_bytes_per_s"]
    reload_s = reload_bytes / h2d
    apply_s = delta_bytes / h2d + touched_bytes / d2d
    dev_reload_s = device_reload_bytes / d2d
    inf = float("inf")
    return dict(limit_reload_host_s=reload_s, limit_reload_device_s=dev_reload_s, limit_apply_s=apply_s,
                physical_limit_ratio=reload_s / apply_s if apply_s else inf,
                physical_limit_ratio_device_reload=dev_reload_s / apply_s if apply_s else inf)


def figures(reloads: Mapping[str, Sequence[float]], storage_bytes: int, weight_bytes: int, touched_bytes: float,
            updates: Sequence[Mapping], stall_s: float, quiet_apply_s: float, device: str = "cuda") -> dict:
    """The CUDA-only result keys of ``bench.engine_update``: the reload baselines (``reloads`` from
    :func:`reload_baselines`; the pageable host one is the bench's ``reload_load_state_dict_median_s``)
    with their ratios to the median stall ``stall_s`` and quiet apply ``quiet_apply_s``, the copy rates
    measured now (:func:`copy_bandwidths`) and the limit they imply (:func:`gpu_limit`; its
    ``physical_limit_ratio`` against a reload from host memory of the ``weight_bytes`` the store serves,
    ``touched_bytes``: the median bytes of touched lines, ``updates[i]["h2d_bytes"]``: what each apply moved
    over PCIe)."""
    bw = copy_bandwidths(storage_bytes, device)
    delta = statistics.median(u["h2d_bytes"] for u in updates)
    lim = gpu_limit(reload_bytes=weight_bytes, device_reload_bytes=storage_bytes, delta_bytes=delta,
                    touched_bytes=touched_bytes, bw=bw)
    pinned, dev = statistics.median(reloads["host_pinned_s"]), statistics.median(reloads["device_s"])
    return dict(physical_limit_basis="PCIe host->device + device memory copy rates", reload_from="host memory",
                reload_host_pinned_median_s=pinned, reload_device_median_s=dev,
                reload_host_pageable_s=list(reloads["host_pageable_s"]),
                reload_host_pinned_s=list(reloads["host_pinned_s"]), reload_device_s=list(reloads["device_s"]),
                ratio_pinned_reload_to_stall=pinned / stall_s, ratio_device_reload_to_stall=dev / stall_s,
                ratio_device_reload_to_quiet_apply=dev / quiet_apply_s,
                delta_h2d_bytes_median=delta, touched_bytes_median=touched_bytes, **bw, **lim)
