"""The trainer's log-probabilities of rollout tokens, with sampling (kept-set) and routing replay.

* :func:`trainer_logprobs`: the training path. One forward of the batch on the model's current weights, under
  routing replay (MoE), the lm_head on the generated tokens' rows only, then
  :func:`syncd.ops.replay.kept_logprobs` of each generated token over its kept set, whose sparse gradient is all
  the lm_head's backward sees. Differentiable; a backward after it recomputes checkpointed layers with the same
  routes.
* :func:`sampler_logprobs`: what the engine computed, recomputed. A sequence whose tokens were sampled under
  several weight versions (an update landed mid-trajectory, while the engine kept its KV cache) is run in
  segments of positions, each on its own version's weights, through one KV cache: positions before an update
  keep the keys and values of the old weights, as in the engine. With ``stepwise`` the prompt runs in one
  forward and then one position per forward, last-row logits only: the shapes the reference engine runs.

Kept sets recorded to be rebuilt (``RolloutBatch.kept_pending``) are rebuilt from the logits each function computes
(:func:`syncd.trainer.rl.kept.fill_kept`): exact where those logits are of the version that sampled the token, which
:func:`sampler_logprobs` always runs and :func:`trainer_logprobs` runs when the model holds that version (on-policy).
:func:`resolve_kept` rebuilds a batch's sets once, from the sampled versions, for a trainer a version or more ahead.

``kept=False`` / ``routing=False`` give the baselines (softmax over the whole vocabulary; the model's own
routes) that the mismatch diagnostics compare against. Greedy rows (temperature 0) were recorded with one kept
token and log-prob 0.
"""

from __future__ import annotations

import dataclasses
import inspect
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from syncd.ops.replay import kept_logprobs
from syncd.trainer.rl.batch import RolloutBatch
from syncd.trainer.rl.kept import FilledKept, fill_kept
from syncd.trainer.rl.replay import observe_routing, routing_replay
from syncd.trainer.rl.rollouts import NO_VERSION, RolloutSequence

__all__ = ["ReplayedLogprobs", "trainer_logprobs", "sampler_logprobs", "resolve_kept"]


@dataclass
class ReplayedLogprobs:
    """``logprobs``: float32 ``[G]`` (the batch's generated tokens, in order); ``disagreement``: share of routed
    (position, layer) pairs where the model's own routers chose other experts than the records (None: dense).
    ``kept``: the kept sets used, rebuilt ones included (None with ``kept=False``); where ``kept.valid`` is False a
    set did not verify (``on_mismatch="drop"``): that token's log-prob is 0 without gradient and must be masked."""

    logprobs: torch.Tensor
    disagreement: float | None = None
    kept: FilledKept | None = None


def _token_logprobs(rows: torch.Tensor, ids, offsets, targets, temperatures: torch.Tensor, *, kept: bool,
                    backend: str, sparse_grad: bool = False) -> torch.Tensor:
    t = temperatures.to(rows.device)
    if t.numel() and bool((t == t[0]).all()):
        x, temp = rows, float(t[0])
    else:  # per-row temperatures: scale in float32 as the sampler did, then temperature 1
        x, temp, sparse_grad = rows.float() / t[:, None], 1.0, False
    if kept:
        return kept_logprobs(x, ids, offsets, targets, temp, backend=backend, sparse_grad=sparse_grad)
    return torch.log_softmax(x.float() / temp, dim=-1).gather(1, targets[:, None].to(torch.int64))[:, 0]


def _routing(model, routes, routing: bool, required=None):
    if routes is None:
        return nullcontext(None)
    return routing_replay(model, routes, required=required) if routing else observe_routing(model, routes)


def _head(model):
    """The model's lm_head when its logits are exactly ``lm_head(last hidden state)`` (no scaling, no softcapping),
    else None."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    cfg = getattr(model, "config", None)
    if not isinstance(head, torch.nn.Linear) or getattr(model, "base_model", model) is model or any(
            getattr(cfg, k, None) not in (None, 1, 1.0) for k in ("final_logit_softcapping", "logit_scale",
                                                                  "logits_scaling")):
        return None
    return head


def _sets(rows, ids, offsets, pending, targets, temperatures, versions, kept: bool, on_mismatch: str,
          backend: str) -> FilledKept | None:
    if not kept:
        return None
    return fill_kept(ids, offsets, pending, rows, targets, temperatures, on_mismatch=on_mismatch, versions=versions,
                     backend="auto" if backend != "reference" else "reference")


def trainer_logprobs(model: torch.nn.Module, batch: RolloutBatch, *, kept: bool = True, routing: bool = True,
                     backend: str = "auto", on_mismatch: str = "raise") -> ReplayedLogprobs:
    """Log-probs of ``batch``'s generated tokens under ``model`` as it is (see the module docstring). When the
    model's logits are its lm_head of the last hidden state, only the generated tokens' rows go through the
    lm_head, and with kept-set replay its backward gets a sparse gradient (the kept entries). Kept sets to rebuild
    are rebuilt from this forward's logits: :class:`syncd.trainer.rl.kept.KeptRebuildError` where they do not verify
    (the model is not the version that sampled them: :func:`resolve_kept` first), or with ``on_mismatch="drop"`` those
    tokens are marked invalid in ``kept.valid``."""
    B, T = batch.shape
    head = _head(model)
    with _routing(model, batch.routes, routing) as rr:
        if head is not None:
            hidden = model.base_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
            rows = head(hidden.reshape(B * T, -1)[batch.rows])
        else:
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
            rows = logits.reshape(B * T, -1)[batch.rows]
        sets = _sets(rows, batch.kept_ids, batch.kept_offsets, batch.kept_pending, batch.targets, batch.temperatures,
                     batch.token_versions, kept, on_mismatch, backend)
        lp = _token_logprobs(rows, None if sets is None else sets.ids, None if sets is None else sets.offsets,
                             batch.targets, batch.temperatures, kept=kept, backend=backend,
                             sparse_grad=head is not None)
    return ReplayedLogprobs(lp, None if rr is None else rr.disagreement, sets)


def _segments(row_versions: torch.Tensor, end: int) -> list[tuple[int, int, int]]:
    """Runs ``(start, stop, version)`` of equal version over rows ``0..end-1``."""
    out, v = [], row_versions[:end].tolist()
    start = 0
    for i in range(1, end + 1):
        if i == end or v[i] != v[start]:
            out.append((start, i, v[start]))
            start = i
    return out


@torch.no_grad()
def sampler_logprobs(model: torch.nn.Module, seq: RolloutSequence, *,
                     weights_of: Callable[[int], Mapping[str, torch.Tensor]] | None = None, kept: bool = True,
                     routing: bool = True, stepwise: bool = False, backend: str = "auto",
                     on_mismatch: str = "raise") -> ReplayedLogprobs:
    """Log-probs of ``seq``'s generated tokens as the engine computed them (see the module docstring).
    ``weights_of(version)``: that version's state dict, loaded into ``model`` before the positions the engine
    ran with it (the model is left holding the last one); None runs every position on the model as it is.
    Raises ValueError for positions of no published version when ``weights_of`` is given."""
    T = len(seq)
    end = int(seq.positions.max())  # rows 0..end-1 predict every generated token
    if weights_of is not None and bool((seq.row_versions[:end] == NO_VERSION).any()):
        raise ValueError("positions the engine ran with weights of no published version: pass weights_of=None")
    segs = _segments(seq.row_versions if weights_of is not None else torch.zeros(T, dtype=torch.int64), end)
    if stepwise:
        first = int(seq.positions.min())
        segs = [(a2, b2, v) for a, b, v in segs for a2, b2 in _steps(a, b, first)]
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    loaded, rows = None, []
    routes = seq.routes
    with _routing(model, None if routes is None else routes[segs[0][0]:segs[0][1]], routing) as rr:
        for a, b, v in segs:
            if weights_of is not None and v != loaded:
                model.load_state_dict(weights_of(v), strict=True)
                loaded = v
            if rr is not None:
                rr.bind(routes[a:b])
            keep = {"logits_to_keep": 1} if stepwise else {}
            out = model(input_ids=seq.tokens[None, a:b], use_cache=True, **{cache_kw: cache}, **keep).logits[0]
            rows.append(out if not stepwise else torch.cat([out.new_zeros(b - a - 1, out.shape[-1]), out]))
        logits = torch.cat(rows)
    pos = seq.positions
    temps = torch.full((pos.numel(),), seq.temperature)
    rows, targets = logits[pos - 1], seq.tokens[pos]
    sets = _sets(rows, seq.kept_ids, seq.kept_offsets, seq.kept_pending, targets, temps, seq.versions[pos], kept,
                 on_mismatch, backend)
    lp = _token_logprobs(rows, None if sets is None else sets.ids, None if sets is None else sets.offsets, targets,
                         temps, kept=kept, backend=backend)
    return ReplayedLogprobs(lp, None if rr is None else rr.disagreement, sets)


def resolve_kept(model: torch.nn.Module, sequences: list[RolloutSequence], *,
                 weights_of: Callable[[int], Mapping[str, torch.Tensor]] | None = None, routing: bool = True,
                 backend: str = "auto") -> list[RolloutSequence]:
    """``sequences`` with every kept set listed: those recorded to be rebuilt are rebuilt from a recomputation of
    the engine's logits (:func:`sampler_logprobs`: each position on the version it ran with, through
    ``weights_of``; the model as it is when None). For a trainer whose weights are ahead of the rollouts' versions.
    Sequences without such sets are returned as they are. Raises :class:`syncd.trainer.rl.kept.KeptRebuildError`."""
    out = []
    for seq in sequences:
        if seq.kept_pending is None:
            out.append(seq)
            continue
        sets = sampler_logprobs(model, seq, weights_of=weights_of, routing=routing, backend=backend).kept
        out.append(dataclasses.replace(seq, kept_ids=sets.ids.to(torch.int32), kept_offsets=sets.offsets,
                                       kept_pending=None))
    return out


def _steps(a: int, b: int, first: int):
    """The engine's forwards over rows ``a..b-1``: rows before ``first`` (the prompt) in one, then one each."""
    if a < first - 1:
        stop = min(b, first)
        yield a, stop
        a = stop
    for r in range(a, b):
        yield r, r + 1
