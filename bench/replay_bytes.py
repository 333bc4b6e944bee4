"""Section 3 of ``bench.replay``, bytes per token of the replay records: kept sets and routes on the recorded
rollouts (:func:`recorded_bytes`) and on the public kept-set distribution (:func:`public_bytes`, with the
information bound for uniformly random ids); the distribution's sampler (:func:`kept_sizes_public`,
:func:`random_sets`) also feeds the op benchmarks (``bench.replay``, ``bench.gpu_replay``)."""

from __future__ import annotations

import math
import statistics

import torch

__all__ = ["kept_sizes_public", "random_sets", "recorded_bytes", "public_bytes"]


def kept_sizes_public(n: int, gen: torch.Generator, top: int) -> torch.Tensor:
    """Kept-set sizes with prime-rl's quantiles: 46% single tokens, median 2, p99 about 82 (a rounded log-normal
    tail, mu 2.2 and sigma 1.05, fitted to those points by sampling; its mean is about 9 ids, which at int32 per id
    is prime-rl's 32-odd bytes per token), at most ``top``."""
    single = torch.rand(n, generator=gen) < 0.46
    tail = torch.exp(2.2 + 1.05 * torch.randn(n, generator=gen)).round().clamp(2, top)
    return torch.where(single, torch.ones(n), tail).long()


def random_sets(sizes: torch.Tensor, V: int, gen: torch.Generator) -> list[torch.Tensor]:
    out = []
    for s in sizes.tolist():
        ids = torch.unique(torch.randint(0, V, (2 * s + 4,), generator=gen))
        while ids.numel() < s:
            ids = torch.unique(torch.cat([ids, torch.randint(0, V, (s,), generator=gen)]))
        out.append(ids[torch.randperm(ids.numel(), generator=gen)[:s]].sort().values)
    return out


def recorded_bytes(store_url: str, run_id: str) -> dict:
    """Bytes per generated token in the run's replay records: kept sets, token routes, whole chunks."""
    from syncd.records.replay import decode_chunk, encode_kept, pack_routing
    from syncd.store import Store

    store = Store(store_url)
    kept = routes = total = tokens = 0
    for o in store.list(f"runs/{run_id}/replay/"):
        raw = store.get(o.key)
        c = decode_chunk(raw)
        tokens += len(c.records)
        total += len(raw)
        kept += sum(len(encode_kept(r.kept, c.vocab_size)) for r in c.records)
        if c.records[0].routing is not None:
            routes += len(pack_routing(torch.stack([torch.as_tensor(r.routing) for r in c.records]).numpy(),
                                       c.num_experts))
    return {"tokens": tokens, "kept_per_token": kept / tokens, "routes_per_token": routes / tokens,
            "chunk_per_token": total / tokens}


def public_bytes(n: int, V: int, seed: int) -> dict:
    from syncd.records.replay import encode_kept
    from syncd.ops.replay import bits_per_id

    gen = torch.Generator().manual_seed(seed)
    sizes = kept_sizes_public(n, gen, 1000)
    sets = random_sets(sizes, V, gen)
    v1 = statistics.fmean(len(encode_kept(s.numpy(), V)) for s in sets)
    bound = statistics.fmean((math.lgamma(V + 1) - math.lgamma(s + 1) - math.lgamma(V - s + 1)) / math.log(2) / 8
                             for s in sizes.tolist())
    E, k, L = 128, 8, 48
    b = bits_per_id(E)
    return {"vocab": V, "tokens": n, "kept_size_median": float(sizes.double().median()),
            "kept_size_p99": float(sizes.double().quantile(0.99)), "single_pct": float(100 * (sizes == 1).double().mean()),
            "kept_size_mean": float(sizes.double().mean()), "kept_v1_per_token": v1, "kept_bound_per_token": bound,
            "int32_ids_per_token": 4 * float(sizes.double().mean()),
            "routes": {"experts": E, "top_k": k, "layers": L, "bits_per_id": b, "per_token": L * k * b / 8,
                       "int32_per_token": L * k * 4}}
