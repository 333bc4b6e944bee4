"""A trainer process for simulated clusters: synthetic weights moved by Adam-like steps of chosen densities,
published with ``syncd.trainer.WeightPublisher`` one version per gate, with what each cost.

    python -m bench.netsim.publisher STORE RUN WORKDIR --params N --densities D1,D2,... [--endpoint URL]
        [--tensor-elems M] [--shard-bytes B] [--delta-format 1|2] [--seed S]

Weights: ``N`` parameters in bf16 tensors of ``M`` elements (:func:`layout`; :func:`write_engine_folder` writes
zeros of the same names and shapes for engine processes to start from), from fp32 master weights (normal, std
0.02). Once they exist the child writes ``WORKDIR/ready.json`` (``{"tensors", "params", "weight_bytes"}``).
Version ``k`` (``k = 0``: the initial weights, a full version; ``k >= 1``: one step whose size is set, on a probe
of the master weights, so that ``Dk`` of the bf16 words change) is prepared first and published once the file
``WORKDIR/gates/k`` exists. One JSON line per version goes to ``WORKDIR/published.jsonl`` once it is committed:
``k``, ``version``, ``kind``, ``density`` (asked), ``density_measured`` and ``changed`` (bf16 words that changed),
``t_call`` (wall time ``publish()`` was called), ``t_commit`` (its manifest write returned: the version is
visible), ``stall_s``, ``snapshot_s``, ``encode_s``, ``upload_s`` (the publisher's own ``VersionStats``),
``bytes`` (shard bytes), ``manifest_bytes`` and ``weight_bytes``.

Version 0 is a full version, every later one a delta (``full_every`` is larger than the schedule). A store
URL ``s3://...`` is written with single-request PUTs (``part_bytes`` of 1 GiB), as ``bench.netsim``'s writable
endpoint takes them. Exit status 0 once every version is committed, 1 if publishing failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

__all__ = ["main", "step_for_density", "layout", "write_engine_folder"]


def layout(params: int, tensor_elems: int) -> list[tuple[str, tuple[int, int]]]:
    """``(name, shape)`` of the tensors holding ``params`` parameters, ``tensor_elems`` each (rows of 1024)."""
    out, left, i = [], params, 0
    while left > 0:
        n = min(left, tensor_elems)
        rows = max(1, n // 1024)
        out.append((f"layers.{i}.weight", (rows, n // rows)))
        left -= rows * (n // rows)
        i += 1
        if n < 1024:
            break
    return out


def write_engine_folder(folder, params: int, tensor_elems: int) -> None:
    """``folder/model.safetensors``: bf16 zeros named and shaped as :func:`layout` (what an engine starts from)."""
    from safetensors.torch import save_file

    Path(folder).mkdir(parents=True, exist_ok=True)
    save_file({n: torch.zeros(shape, dtype=torch.bfloat16) for n, shape in layout(params, tensor_elems)},
              str(Path(folder) / "model.safetensors"))


def step_for_density(w: torch.Tensor, move: torch.Tensor, density: float) -> float:
    """The step size ``s`` such that ``w + move * s`` changes about ``density`` of ``w``'s bf16 words (bisected on
    the log scale on the given probe)."""
    old = w.to(torch.bfloat16)
    lo, hi = -30.0, 0.0
    for _ in range(40):
        mid = (lo + hi) / 2
        got = ((w + move * 2.0 ** mid).to(torch.bfloat16) != old).float().mean().item()
        lo, hi = (mid, hi) if got < density else (lo, mid)
    return 2.0 ** ((lo + hi) / 2)


class _Moves:
    """The random parts of one step per tensor (a sign times U(0.5, 1.5)), from one generator."""

    def __init__(self, seed: int):
        self.g = torch.Generator().manual_seed(seed)

    def __call__(self, n: int) -> torch.Tensor:
        return torch.randn(n, generator=self.g).sign_() * (0.5 + torch.rand(n, generator=self.g))


def prepare(master: dict, density: float | None, moves: _Moves) -> tuple[dict, int]:
    """Move ``master`` (fp32, in place) by one step of ``density`` (None: leave it) and return its bf16 snapshot
    and the number of bf16 words that changed."""
    if density is None:
        return {n: t.to(torch.bfloat16) for n, t in master.items()}, 0
    first = next(iter(master.values())).view(-1)
    probe = first[: 1 << 20]
    scale = step_for_density(probe, moves(probe.numel()), density)
    snap, changed = {}, 0
    for n, t in master.items():
        old = t.to(torch.bfloat16)
        t.add_(moves(t.numel()).view(t.shape), alpha=scale)
        snap[n] = t.to(torch.bfloat16)
        changed += int((snap[n].view(torch.int16) != old.view(torch.int16)).sum())
    return snap, changed


def _store(url: str, endpoint: str | None, commits: list):
    """The store to publish to; ``commits`` gets the wall time each manifest write returned."""
    from syncd.store import Store

    class Timed(Store):
        def put(self, key, data, *, create=False):
            out = super().put(key, data, create=create)
            if key.endswith("manifest.json"):
                commits.append(time.time())
            return out

    return Timed(url, endpoint=endpoint, part_bytes=1 << 30)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.netsim.publisher", description=__doc__.split("\n\n")[0])
    p.add_argument("store")
    p.add_argument("run")
    p.add_argument("workdir")
    p.add_argument("--endpoint", default=None)
    p.add_argument("--params", type=int, required=True)
    p.add_argument("--densities", required=True, help="changed bf16 words of versions 1, 2, ... (fractions)")
    p.add_argument("--tensor-elems", type=int, default=1 << 22)
    p.add_argument("--shard-bytes", type=int, default=4 << 20)
    p.add_argument("--delta-format", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    from syncd.publish.publisher import WeightPublisher

    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(a.seed)
    master = {n: torch.randn(shape) * 0.02 for n, shape in layout(a.params, a.tensor_elems)}
    params = sum(t.numel() for t in master.values())
    (work / "ready.json").write_text(json.dumps({"tensors": len(master), "params": params, "weight_bytes": 2 * params}))
    schedule = [None] + [float(x) for x in a.densities.split(",")]
    commits: list[float] = []
    pub = WeightPublisher(_store(a.store, a.endpoint, commits), a.run, full_every=len(schedule) + 1,
                          shard_bytes=a.shard_bytes, delta_format=a.delta_format)
    moves = _Moves(a.seed + 1)
    try:
        for k, density in enumerate(schedule):
            snap, changed = prepare(master, density, moves)
            while not (work / "gates" / str(k)).exists():
                time.sleep(0.01)
            t_call = time.time()
            pub.publish(snap, k)
            pub.flush()
            st = pub.history[-1]
            rec = {"k": k, "version": st.version, "kind": st.kind, "density": density,
                   "density_measured": changed / params, "changed": changed, "t_call": t_call,
                   "t_commit": commits[-1], "stall_s": st.stall_s, "snapshot_s": st.snapshot_s,
                   "encode_s": st.encode_s, "upload_s": st.upload_s, "bytes": st.shard_bytes,
                   "manifest_bytes": st.manifest_bytes,
                   "weight_bytes": 2 * params}
            with open(work / "published.jsonl", "a") as fh:
                fh.write(json.dumps(rec) + "\n")
            del snap
        pub.close()
    except Exception as exc:  # noqa: BLE001 -- reported to the parent through the exit status and the log
        print(f"bench.netsim.publisher: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    os.environ.setdefault("SYNCD_LOG_LEVEL", "WARNING")
    sys.exit(main())
