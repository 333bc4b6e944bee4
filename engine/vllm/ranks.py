"""The tensor-parallel ranks of one vLLM engine seen as one Adapter (:class:`syncd.engine.vllm.VLLMEngine`).

Every worker rank holds its own slices (:func:`syncd.engine.vllm.layout.vllm_specs` with its rank) and answers every
``collective_rpc`` for itself; this module names and merges what the ranks answer. With one rank nothing is
renamed. With several, a local parameter is ``tp<rank>.<vLLM name>`` (the convention of
:class:`syncd.engine.reference.tp.TPRunner`), so the engine's parameters and checksums cover every rank and
``expected_checksums`` over them checks every slice. Pure functions; thread-safe.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Sequence

from syncd.engines.params import ParamSpec

__all__ = ["local_name", "names_by_rank", "merge_specs", "merge_checksums", "merge_stage", "merge_write",
           "cpu_shares", "cpu_thread_binding", "parse_cpu_list"]


def local_name(rank: int, name: str, world: int) -> str:
    """The engine-level name of rank ``rank``'s parameter ``name``."""
    return name if world == 1 else f"tp{rank}.{name}"


def names_by_rank(names: Sequence[str], world: int) -> list[list[str]]:
    """Engine-level ``names`` split into each rank's own names (index: rank). KeyError for a name that names no
    rank (with several ranks every name starts with ``tp<rank>.``)."""
    out: list[list[str]] = [[] for _ in range(world)]
    for n in names:
        if world == 1:
            out[0].append(n)
            continue
        head, dot, rest = n.partition(".")
        r = int(head[2:]) if head.startswith("tp") and head[2:].isdigit() and dot else -1
        if not 0 <= r < world:
            raise KeyError(f"no local parameter named {n!r} (with {world} tensor-parallel ranks a name starts "
                           "with tp<rank>.)")
        out[r].append(rest)
    return out


def merge_specs(per_rank: Sequence[Sequence[ParamSpec]]) -> list[ParamSpec]:
    """Every rank's specs under engine-level names, rank by rank."""
    world = len(per_rank)
    return [replace(s, name=local_name(r, s.name, world)) for r, specs in enumerate(per_rank) for s in specs]


def merge_checksums(per_rank: Sequence[dict]) -> dict[str, int]:
    """Every rank's ``{name: checksum}`` (checksums as the decimal strings the RPC carries) under engine-level
    names."""
    world = len(per_rank)
    return {local_name(r, k, world): int(v) for r, c in enumerate(per_rank) for k, v in c.items()}


def merge_stage(per_rank: Sequence[dict]) -> dict:
    """One stage result from every rank's: the version (which every rank must agree on; RuntimeError
    otherwise), words and bytes summed, seconds the slowest rank's."""
    _one_version(per_rank, "staged")
    out = dict(per_rank[0])
    if len(per_rank) > 1:
        out.update(words=sum(r["words"] for r in per_rank), bytes=sum(r["bytes"] for r in per_rank),
                   seconds=max(r["seconds"] for r in per_rank),
                   prepare_s=max(r.get("prepare_s", 0.0) for r in per_rank), ranks=list(per_rank))
    return out


def merge_write(per_rank: Sequence[dict]) -> dict:
    """One write result (``syncd_last`` of an apply, rollback or load_full) from every rank's: the version
    (RuntimeError unless every rank holds the same), counts summed, times the slowest rank's."""
    _one_version(per_rank, "wrote")
    out = dict(per_rank[0])
    if len(per_rank) > 1:
        for k in ("words", "swapped", "rebuilt"):
            if k in out:
                out[k] = sum(r.get(k, 0) for r in per_rank)
        for k in ("write_s", "derive_s"):
            if k in out:
                out[k] = max(r.get(k, 0.0) for r in per_rank)
        out["ranks"] = list(per_rank)
    return out


def _one_version(per_rank: Sequence[dict], what: str) -> None:
    versions = [r.get("version") for r in per_rank]
    if len(set(versions)) != 1:
        raise RuntimeError(f"the tensor-parallel ranks {what} different versions: {versions} (rank order)")


def cpu_shares(n: int, cpus: Sequence[int] | None = None) -> list[str]:
    """``n`` equal contiguous shares of ``cpus`` (default: the cores this process may use) as vLLM's CPU id
    lists (``"0,1,2,3"``), one per rank or engine. ValueError with fewer cores than shares."""
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if len(cpus) < n:
        raise ValueError(f"{n} vLLM CPU ranks or engines need at least {n} cores; {len(cpus)} are allowed")
    per = len(cpus) // n
    return [",".join(str(c) for c in cpus[r * per:(r + 1) * per]) for r in range(n)]


def parse_cpu_list(text: str) -> list[int]:
    """CPU ids of a list such as ``"0,2-4"`` (vLLM's and Linux's syntax). ValueError naming the text if it is not
    one."""
    out = []
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            out.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ValueError(f"not a CPU id list: {text!r} (expected e.g. 0,2-4)") from None
    return out


def cpu_thread_binding(world: int, cpus: Sequence[int] | None = None) -> str:
    """A ``VLLM_CPU_OMP_THREADS_BIND`` value giving each of ``world`` CPU worker ranks an equal contiguous share
    of ``cpus`` (:func:`cpu_shares`), e.g. ``"0,1,2,3|4,5,6,7"``. vLLM's automatic binding wants a NUMA node per
    rank and refuses to start otherwise. ValueError with fewer cores than ranks."""
    return "|".join(cpu_shares(world, cpus))
