"""Section 3 of ``bench.replay``, bytes per token of the replay records: kept sets (as recorded, by form, next to
format 1 and int32 ids) and routes on the recorded rollouts (:func:`recorded_bytes`), routes at a large MoE's shape
(:func:`route_bytes`), and the section's printout (:func:`print_bytes`); the kept sets on synthetic logits with the
public distribution are ``bench.replay_kept``'s. The distribution's size sampler (:func:`kept_sizes_public`) and
uniformly random sets (:func:`random_sets`) also feed the op benchmarks (``bench.replay``, ``bench.gpu_replay``)."""

from __future__ import annotations

import torch

__all__ = ["kept_sizes_public", "random_sets", "recorded_bytes", "route_bytes", "print_bytes"]


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


def kept_problem(T: int, V: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """``T`` rows of kept sets over a vocabulary of ``V`` with the public size distribution, each with a target
    inside its set: ``(ids, offsets, targets, rows)`` as ``syncd.ops.replay.kept_logprobs`` takes them (``rows``:
    each id's row, ``kept_rows(offsets)``)."""
    from syncd.ops.replay import kept_rows

    sizes = kept_sizes_public(T, gen, 1000)
    sets = random_sets(sizes, V, gen)
    ids = torch.cat(sets)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)])
    targets = torch.stack([s[torch.randint(0, s.numel(), (1,), generator=gen)][0] for s in sets])
    return ids, offsets, targets, kept_rows(offsets)


def recorded_bytes(store_url: str, run_id: str, resolved) -> dict:
    """Bytes per generated token in the run's replay records: kept sets as recorded (format 2) and by form, the same
    sets listed (format 1, from the ``resolved`` sequences) and as int32 ids, token routes, whole chunks."""
    from syncd.records.replay import decode_chunk, encode_kept, encode_kept_record, pack_routing
    from syncd.records.replay_kept import kept_form
    from syncd.store import Store

    store = Store(store_url)
    kept = routes = total = tokens = 0
    forms: dict[str, int] = {}
    for o in store.list(f"runs/{run_id}/replay/"):
        raw = store.get(o.key)
        c = decode_chunk(raw)
        tokens += len(c.records)
        total += len(raw)
        for r in c.records:
            blob = encode_kept_record(r.kept, r.token_id, c.vocab_size, tolerance=c.kept_tolerance)
            kept += len(blob)
            form = kept_form(blob)
            forms[form] = forms.get(form, 0) + 1
        if c.records[0].routing is not None:
            routes += len(pack_routing(torch.stack([torch.as_tensor(r.routing) for r in c.records]).numpy(),
                                       c.num_experts))
    listed = int32 = n = 0
    for seq in resolved:
        for g in range(seq.positions.numel()):
            ids = seq.kept_ids[seq.kept_offsets[g]:seq.kept_offsets[g + 1]].numpy()
            listed += len(encode_kept(ids, seq.vocab_size))
            int32 += 4 * ids.size
            n += 1
    return {"tokens": tokens, "kept_per_token": kept / tokens, "kept_forms_pct": {k: 100 * v / tokens for k, v in
                                                                                  forms.items()},
            "kept_listed_v1_per_token": listed / max(n, 1), "kept_int32_per_token": int32 / max(n, 1),
            "routes_per_token": routes / tokens, "chunk_per_token": total / tokens}


def route_bytes() -> dict:
    from syncd.ops.replay import bits_per_id

    E, k, L = 128, 8, 48
    b = bits_per_id(E)
    return {"experts": E, "top_k": k, "layers": L, "bits_per_id": b, "per_token": L * k * b / 8,
            "int32_per_token": L * k * 4}


def print_bytes(results: dict, tolerance: float) -> None:
    """Print the bytes section of ``bench.replay``'s ``results`` (recorded with ``tolerance``)."""
    pk = results["bytes"]["public"]
    ks = pk["kept_size"]
    print(f"\nbytes per token of kept sets, synthetic logits at V={pk['vocab']:,} whose top-p {pk['top_p']} sets "
          f"follow the public distribution ({pk['tokens']} tokens: median {ks['median']:.0f}, p99 {ks['p99']:.0f}, "
          f"{ks['single_pct']:.0f}% single, mean {ks['mean']:.1f}; ids uniform):")
    print(f"  format 1, every id listed {pk['listed_v1_per_token']:6.2f} B   int32 ids "
          f"{pk['int32_ids_per_token']:6.2f} B   bound of any listing {pk['listed_bound_per_token']:6.2f} B   "
          f"prime-rl about {results['public']['prime_rl_bytes_per_token']} B   goal <= 8 B")
    for d, r in pk["by_tolerance"].items():
        forms = ", ".join(f"{k} {v:.1f}%" for k, v in sorted(r["forms_pct"].items()))
        print(f"  format 2, tolerance {float(d):g}: {r['per_token']:6.2f} B/token "
              f"({pk['listed_v1_per_token'] / r['per_token']:.1f}x less than listed; fragile boundary "
              f"{r['fragile_pct']:.1f}%, listed {r['listed_pct']:.1f}%; {forms}); "
              f"rebuilt within the tolerance: {r['rebuilt_within_exact']}/{r['rebuilt_within']} exact; logits 10x "
              f"beyond it: {r['beyond_refused']} refused, {r['beyond_verified']} still verified, "
              f"{r['beyond_wrong']} wrong")
    op = pk["op"]
    lm = "" if op["rebuild_vs_lm_head"] is None else f", {100 * op['rebuild_vs_lm_head']:.2f}% of the lm_head matmul"
    print(f"  rebuilding {op['rebuilt_rows']} of {op['rows']} rows (tolerance {tolerance:g}; {op['rebuilt_verified']} "
          f"verified): {op['rebuild_s'] * 1e3:.1f} ms, next to kept_logprobs forward + backward on those {op['rows']} "
          f"rows {op['kept_logprobs_cpu_s'] * 1e3:.1f} ms (cpu; {op['rebuild_vs_kept_logprobs']:.2f}x), "
          f"{op['kept_logprobs_cpu_sparse_s'] * 1e3:.1f} ms with a sparse gradient{lm}; the engine's kept_sets "
          f"{pk['engine_kept_sets_s_per_token'] * 1e3:.2f} ms per token")
    r = results["bytes"]["routes"]
    print(f"routes, E={r['experts']} top-{r['top_k']} x {r['layers']} layers: {r['per_token']:.0f} B/token at "
          f"{r['bits_per_id']} bits per id, int32 {r['int32_per_token']} B "
          f"({r['int32_per_token'] / r['per_token']:.2f}x)")
    for m in results["mismatch"]:
        b, rb = m["bytes"], m["rebuild"]
        forms = ", ".join(f"{k} {v:.0f}%" for k, v in sorted(b["kept_forms_pct"].items()))
        print(f"recorded ({m['model']}, V=320, tolerance {tolerance:g}): kept sets {b['kept_per_token']:.2f} B/token "
              f"(format 1 {b['kept_listed_v1_per_token']:.2f} B, int32 {b['kept_int32_per_token']:.1f} B; {forms}); "
              f"{rb['rebuilt']}/{rb['pending']} rebuilt from the sampled versions, {rb['mismatches']} mismatches "
              f"(a trainer a version ahead, from its own logits: {rb['newest_own_verified']} verified, "
              f"{rb['newest_own_refused']} refused); routes {b['routes_per_token']:.1f} B/token, whole chunks "
              f"{b['chunk_per_token']:.1f} B/token")
