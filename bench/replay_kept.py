"""Kept sets on the wire, for ``bench.replay``: bytes per token of the replay format's kept-set column (format 2:
sets the trainer rebuilds from its logits; format 1: every id listed; int32 ids, as public frameworks send them),
the share of sets listed because their ranking is fragile, the rebuild's exactness and its cost next to the
``kept_logprobs`` op.

Kept sets need logits now, so the public distribution (prime-rl: median 2, p99 about 82, 45-48% single tokens, at
V = 151,936) is produced by synthetic logits: each row's ranked scaled logits are ``-alpha * c_j`` with
``c_j = sum_{i<j} e_i log((i + 1) / i)``, ``e_i ~ Exp(1)`` (Zipf's law ``-alpha log j`` on average, with the
exponential spacings of order statistics; ranks past 2048 on the average curve), over a random permutation of the
vocabulary. ``alpha`` is solved per row so that top-p 0.8 keeps a size drawn from the public distribution, with
``top_p`` falling uniformly within the last kept rank's mass. How fragile a boundary is follows from those spacings
(rank ``n``'s gap is about ``alpha / n``): a model, stated as such; the recorded rollouts of ``bench.replay`` are
the real counterpart (tiny models, V = 320).
"""

from __future__ import annotations

import math

import torch

from bench._timing import Stopwatch, median_time
from bench.replay_bytes import kept_sizes_public

TOP_P = 0.8
_HEAD = 2048  # ranks with random spacings; the tail follows the average curve


class ZipfLogits:
    """Synthetic logits rows at vocabulary ``V`` whose top-p sets follow the public size distribution (module
    docstring). Deterministic in ``seed``."""

    def __init__(self, V: int, seed: int, top_p: float = TOP_P):
        self.V, self.top_p = V, top_p
        self.gen = torch.Generator().manual_seed(seed)
        # log sum_{j > HEAD}^{V} j^-alpha on a grid of alpha, interpolated (the tail's mass relative to rank HEAD)
        self.grid = torch.linspace(math.log(0.05), math.log(80.0), 2000, dtype=torch.float64).exp()
        j = torch.arange(_HEAD + 1, V + 1, dtype=torch.float64).log()
        self.log_tail = torch.stack([torch.logsumexp(-a * j, 0) for a in self.grid]) if V > _HEAD else None

    def _tail(self, alpha: torch.Tensor) -> torch.Tensor:
        x = alpha.log().clamp(float(self.grid[0].log()), float(self.grid[-1].log()))
        pos = (x - self.grid[0].log()) / (self.grid[-1].log() - self.grid[0].log()) * (self.grid.numel() - 1)
        lo = pos.floor().long().clamp(max=self.grid.numel() - 2)
        w = pos - lo
        return self.log_tail[lo] * (1 - w) + self.log_tail[lo + 1] * w

    def batch(self, B: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits [B, V] float32, the sizes they were solved for [B])``."""
        g, V = self.gen, self.V
        head = min(_HEAD, V)
        sizes = kept_sizes_public(B, g, min(1000, head - 1))
        i = torch.arange(1, head, dtype=torch.float64)
        e = torch.empty(B, head - 1, dtype=torch.float64).exponential_(generator=g)
        c = torch.cat([torch.zeros(B, 1, dtype=torch.float64), (e * torch.log1p(1 / i)).cumsum(1)], 1)  # [B, head]
        u = torch.rand(B, generator=g, dtype=torch.float64)
        u = torch.where(sizes == 1, self.top_p + (1 - self.top_p) * u, u)  # a single rank holds at least top_p
        rows = torch.arange(B)

        def h(alpha):  # mass of the first n - 1 ranks + u * rank n's, increasing in alpha
            lz = -alpha[:, None] * c
            total = torch.logsumexp(lz, 1)
            if self.log_tail is not None:
                total = torch.logaddexp(total, lz[:, -1] + alpha * math.log(head) + self._tail(alpha))
            p = (lz - total[:, None]).exp()
            before = torch.cumsum(p, 1)[rows, sizes - 1] - p[rows, sizes - 1]
            return before + u * p[rows, sizes - 1]

        lo, hi = torch.full((B,), 0.05, dtype=torch.float64), torch.full((B,), 80.0, dtype=torch.float64)
        for _ in range(60):
            mid = (lo * hi).sqrt()
            up = h(mid) < self.top_p
            lo, hi = torch.where(up, mid, lo), torch.where(up, hi, mid)
        alpha = (lo * hi).sqrt()
        vals = -alpha[:, None] * c
        if V > head:
            tail = torch.arange(head + 1, V + 1, dtype=torch.float64).log() - math.log(head)
            vals = torch.cat([vals, vals[:, -1:] - alpha[:, None] * tail[None, :]], 1)
        logits = torch.empty(B, V)
        for b in range(B):
            logits[b, torch.randperm(V, generator=g)] = vals[b].float()
        return logits, sizes


def _bound_bytes(n: int, V: int) -> float:
    """Bytes of the information bound of an explicit set of ``n`` uniformly random ids: log2 C(V, n) / 8."""
    return (math.lgamma(V + 1) - math.lgamma(n + 1) - math.lgamma(V - n + 1)) / math.log(2) / 8


def _record(ks, t: int, token: int, V: int, delta: float) -> bytes:
    from syncd.records.replay import encode_kept_record

    a, b = int(ks.offsets[t]), int(ks.offsets[t + 1])
    return encode_kept_record(ks.ids[a:b].numpy(), token, V, margins=ks.gaps[a:b].numpy(), tolerance=delta)


def _tolerance_pass(acc: dict, logits: torch.Tensor, ks, tokens: list[int], V: int, d: float,
                    gen: torch.Generator) -> None:
    """One batch at tolerance ``d``: every row's record written (bytes, form, fragile boundary), and the rows
    recorded to rebuild rebuilt from logits moved within the tolerance (must give the same set) and beyond it (must
    be refused or still give it); counts added to ``acc``."""
    from syncd.records.replay import KeptToRebuild, decode_kept
    from syncd.records.replay_kept import kept_form

    noise = (torch.rand(logits.shape, generator=gen) * 2 - 1) * 0.9 * d  # within the tolerance (T = 1)
    beyond = torch.randn(logits.shape, generator=gen) * 10 * d
    pend = []
    for t in range(logits.shape[0]):
        blob = _record(ks, t, tokens[t], V, d)
        acc["bytes"] += len(blob)
        form = kept_form(blob)
        acc["forms"][form] = acc["forms"].get(form, 0) + 1
        a, b = int(ks.offsets[t]), int(ks.offsets[t + 1])
        acc["fragile"] += int(b - a > 1 and not bool(ks.gaps[b - 1] > 2 * d))
        k = decode_kept(blob, V, token_id=tokens[t], tolerance=d)
        if isinstance(k, KeptToRebuild):
            pend.append((t, k))
    if not pend:
        return
    for name, x in (("within", logits + noise), ("beyond", logits + beyond)):
        rb = _rebuild(x, pend)
        for j, (t, k) in enumerate(pend):
            same = torch.equal(rb.ids[rb.offsets[j]:rb.offsets[j + 1]],
                               ks.ids[ks.offsets[t]:ks.offsets[t + 1]].sort().values)
            ok = int(rb.status[j]) == 0
            if name == "within":
                acc["rebuilt"] += 1
                acc["rebuilt_ok"] += int(ok and same)
            else:
                acc["beyond_ok"] += int(ok and same)
                acc["beyond_caught"] += int(not ok)
                acc["beyond_wrong"] += int(ok and not same)


def _tolerance_figures(acc: dict, rows: int) -> dict:
    """The JSON figures of one tolerance's counts over ``rows`` tokens."""
    return {"per_token": acc["bytes"] / rows, "forms_pct": {k: 100 * v / rows for k, v in acc["forms"].items()},
            "fragile_pct": 100 * acc["fragile"] / rows,
            "listed_pct": 100 * sum(acc["forms"].get(k, 0) for k in ("list", "bitmap")) / rows,
            "rebuilt_within": acc["rebuilt"], "rebuilt_within_exact": acc["rebuilt_ok"],
            "beyond_verified": acc["beyond_ok"], "beyond_refused": acc["beyond_caught"],
            "beyond_wrong": acc["beyond_wrong"]}


def public_kept(rows: int, V: int, seed: int, deltas=(1e-3, 1e-2, 1e-1), *, batch: int = 32, op_rows: int = 0,
                repeats: int = 3) -> dict:
    """Bytes per token of kept sets on synthetic logits with the public size distribution, each next to the
    listed encodings on the same sets; rebuild exactness within and beyond the tolerance; and, on the first
    ``op_rows`` rows, the rebuild's time next to ``kept_logprobs``."""
    from syncd.ops.replay import kept_sets
    from syncd.records.replay import encode_kept

    src = ZipfLogits(V, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    per = {d: {"bytes": 0, "forms": {}, "fragile": 0, "rebuilt_ok": 0, "rebuilt": 0, "beyond_caught": 0,
               "beyond_wrong": 0, "beyond_ok": 0} for d in deltas}
    v1 = int32 = bound = 0
    sizes, targets, kept_s, t_engine = [], [], [], 0.0
    keep_logits = []
    done = 0
    while done < rows:
        B = min(batch, rows - done)
        logits, want = src.batch(B)
        t0 = Stopwatch()
        ks = kept_sets(logits, 1.0, 0, TOP_P)  # the engine's sampler
        t_engine += t0.elapsed
        n = ks.offsets[1:] - ks.offsets[:-1]
        tokens = []
        for t in range(B):
            a, b = int(ks.offsets[t]), int(ks.offsets[t + 1])
            j = int(torch.multinomial(ks.logprobs[a:b].exp(), 1, generator=gen))
            tokens.append(int(ks.ids[a + j]))
            ids = ks.ids[a:b].sort().values.numpy()
            v1 += len(encode_kept(ids, V))
            int32 += 4 * (b - a)
            bound += _bound_bytes(b - a, V)
        sizes.append(n)
        targets.append(torch.tensor(tokens))
        for d, acc in per.items():
            _tolerance_pass(acc, logits, ks, tokens, V, d, gen)
        if sum(x.shape[0] for x in keep_logits) < op_rows:
            keep_logits.append(logits[:op_rows - sum(x.shape[0] for x in keep_logits)])
            kept_s.append(ks)
        done += B
    n = torch.cat(sizes).double()
    out = {"vocab": V, "tokens": rows, "top_p": TOP_P, "engine_kept_sets_s_per_token": t_engine / rows,
           "kept_size": {"median": float(n.median()), "p99": float(n.quantile(0.99)), "mean": float(n.mean()),
                         "single_pct": float(100 * (n == 1).double().mean())},
           "listed_v1_per_token": v1 / rows, "int32_ids_per_token": int32 / rows,
           "listed_bound_per_token": bound / rows,
           "by_tolerance": {repr(d): _tolerance_figures(acc, rows) for d, acc in per.items()}}
    if op_rows:
        out["op"] = rebuild_cost(torch.cat(keep_logits), _cat_sets(kept_s, op_rows), torch.cat(targets)[:op_rows],
                                 deltas[0], repeats)
    return out


def _rebuild(x: torch.Tensor, pend):
    from syncd.ops.replay import rebuild_kept

    rows = torch.tensor([t for t, _ in pend])
    ex = torch.tensor([k.extra.size for _, k in pend], dtype=torch.int64)
    return rebuild_kept(x[rows], torch.tensor([k.top for _, k in pend]),
                        torch.cat([torch.from_numpy(k.extra) for _, k in pend]),
                        torch.cat([torch.zeros(1, dtype=torch.int64), ex.cumsum(0)]),
                        torch.tensor([k.fingerprint for _, k in pend]))


def _cat_sets(parts, rows: int):
    """The first ``rows`` rows of several KeptSets, as (ids ascending per row, offsets, gaps at each row's end)."""
    ids, sizes, last_gap = [], [], []
    for ks in parts:
        for t in range(ks.offsets.numel() - 1):
            if len(sizes) == rows:
                break
            a, b = int(ks.offsets[t]), int(ks.offsets[t + 1])
            ids.append(ks.ids[a:b].sort().values)
            sizes.append(b - a)
            last_gap.append(float(ks.gaps[b - 1]))
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.tensor(sizes).cumsum(0)])
    return torch.cat(ids), offsets, torch.tensor(last_gap)


def rebuild_cost(logits: torch.Tensor, sets, targets: torch.Tensor, delta: float, repeats: int) -> dict:
    """Median seconds of rebuilding the rows a recorder with ``delta`` writes to rebuild (all robust sets of more
    than one id, from logits within the tolerance) next to ``kept_logprobs`` forward + backward on the same rows."""
    from syncd.ops.replay import kept_fingerprint, kept_logprobs, rebuild_kept

    ids, offsets, last_gap = sets
    T = logits.shape[0]
    n = offsets[1:] - offsets[:-1]
    rows = ((n > 1) & (last_gap > 2 * delta)).nonzero()[:, 0]
    top = n[rows]
    fps = kept_fingerprint(ids, offsets)[rows]
    empty = torch.zeros(rows.numel() + 1, dtype=torch.int64)

    res = {"rows": T, "vocab": logits.shape[1], "rebuilt_rows": int(rows.numel())}
    rb = rebuild_kept(logits[rows], top, torch.zeros(0, dtype=torch.int64), empty, fps)
    res["rebuilt_verified"] = int((rb.status == 0).sum())
    res["rebuild_s"] = median_time(lambda: rebuild_kept(logits[rows], top, torch.zeros(0, dtype=torch.int64), empty,
                                                        fps), repeats)
    x = logits.clone().requires_grad_()
    for name, kw in (("kept_logprobs_cpu_s", dict(backend="cpu")),
                     ("kept_logprobs_cpu_sparse_s", dict(backend="cpu", sparse_grad=True))):
        def fwd_bwd(kw=kw):
            kept_logprobs(x, ids, offsets, targets, **kw).sum().backward()
            x.grad = None
        res[name] = median_time(fwd_bwd, repeats)
    res["rebuild_vs_kept_logprobs"] = res["rebuild_s"] / res["kept_logprobs_cpu_s"]
    return res
