"""Replay records from vLLM's outputs: what a finished ``vllm.outputs.RequestOutput`` carries for replay --
``sampling_mask`` (the kept token ids of every generated token), ``routed_experts`` (the experts of every
position) and ``weight_versions`` (per-token version spans) -- onto syncd's replay records
(:class:`syncd.records.replay.TokenRecord`, written by :class:`syncd.engine.replay.ReplayRecorder`;
``docs/replay-format.md``).

=================================  ==============================================================================
vLLM (final output of a request)   replay record
=================================  ==============================================================================
``prompt_token_ids`` (P tokens)    token ``i`` is at absolute position ``P + i``, index ``i``
``outputs[0].token_ids[i]``        ``token_id``
``outputs[0].logprobs[i]``         ``logprob`` of the sampled token (under the sampling distribution with
                                   ``logprobs_mode="processed_logprobs"``, which replay needs)
``sampling_mask.token_ids[i]``     ``kept`` (sorted ascending; must hold the sampled token). vLLM's engine keeps
                                   them as CSR (``SamplingMaskLists``: flat ids plus offsets) and hands nested
                                   lists out; either form is taken
``routed_experts`` ``[T-1, L, k]`` rows are positions ``0 .. P+n-2`` (the last sampled token is never
(uint8 when E <= 256, else         forwarded): record ``i`` gets row ``P+i-1`` (the position whose logits sampled
uint16)                            it), and rows ``0 .. P-2`` are the prompt's routing
``weight_versions`` spans          ``version`` (syncd's int versions as vLLM's string labels)
=================================  ==============================================================================

These fields need vLLM's Model Runner V2, which needs a GPU; on CPU vLLM leaves them None, and
:func:`record_output` then raises ``ValueError`` naming what is missing. Pure functions over the output.
"""

from __future__ import annotations

import numpy as np

from syncd.engine.vllm.outputs import spans_to_versions

__all__ = ["kept_sets", "routes", "record_output"]


def kept_sets(mask, n: int) -> list[np.ndarray]:
    """The kept ids of each of ``n`` tokens from a ``SamplingMask`` (nested lists) or a CSR form (an object with
    flat ``token_ids`` and ``offsets``, as ``vllm.v1.outputs.SamplingMaskLists``), sorted ascending."""
    ids = getattr(mask, "token_ids", None)
    offsets = getattr(mask, "offsets", None)
    if ids is None:
        raise ValueError("the output has no sampling_mask (needs return_sampling_mask=True, Model Runner V2)")
    if offsets is None and isinstance(ids, np.ndarray) and ids.ndim == 1:  # CSR of a single position
        offsets = [0, ids.size]
    if offsets is not None:
        flat, off = np.asarray(ids, dtype=np.int64).reshape(-1), np.asarray(offsets, dtype=np.int64).reshape(-1)
        if off.size != n + 1 or off[0] != 0 or off[-1] != flat.size or np.any(np.diff(off) < 0):
            raise ValueError(f"sampling_mask offsets {off.size} do not describe {n} tokens over {flat.size} ids")
        rows = [flat[off[i]:off[i + 1]] for i in range(n)]
    else:
        if len(ids) != n:
            raise ValueError(f"sampling_mask has {len(ids)} kept sets for {n} tokens")
        rows = [np.asarray(r, dtype=np.int64) for r in ids]
    return [np.unique(r) for r in rows]


def routes(routed, prompt_len: int, n: int, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """``(prompt, tokens)`` of ``routed_experts`` ``[prompt_len + n - 1, L, k]``: the prompt's rows ``[P-1, L, k]``
    and each generated token's ``[n, L, k]`` (the row before its position), int16."""
    r = np.asarray(routed)
    if r.ndim != 3 or r.shape[0] != prompt_len + n - 1:
        raise ValueError(f"routed_experts has shape {list(r.shape)}, expected [{prompt_len + n - 1}, layers, top_k] "
                         f"for {prompt_len} prompt and {n} generated tokens")
    if r.size and (r.min() < 0 or r.max() >= num_experts):
        raise ValueError(f"routed_experts holds expert ids outside 0..{num_experts - 1}")
    r = r.astype(np.int16)
    return r[:prompt_len - 1], r[prompt_len - 1:]


def record_output(recorder, out, *, num_experts: int = 0) -> int:
    """Add the replay records of finished ``RequestOutput`` ``out`` (first completion) to ``recorder`` (an
    :class:`syncd.engine.replay.ReplayRecorder`) and finish the request there; returns the number of tokens. Raises
    ``ValueError`` for an unfinished output, one without the replay fields, or fields that disagree."""
    if not out.finished:
        raise ValueError(f"request {out.request_id!r}: replay records come from the final output")
    c = out.outputs[0]
    prompt, toks = list(out.prompt_token_ids or ()), list(c.token_ids)
    n = len(toks)
    versions = spans_to_versions(c.weight_versions, n)
    kept = kept_sets(c.sampling_mask, n)
    if c.logprobs is None or len(c.logprobs) != n:
        raise ValueError(f"request {out.request_id!r}: needs the sampled token's logprob for each of {n} tokens")
    prompt_routes = token_routes = None
    if num_experts:
        if c.routed_experts is None:
            raise ValueError(f"request {out.request_id!r}: a MoE model's output has no routed_experts "
                             "(needs enable_return_routed_experts=True, Model Runner V2)")
        prompt_routes, token_routes = routes(c.routed_experts, len(prompt), n, num_experts)
    for i, tok in enumerate(toks):  # everything is checked before anything is recorded
        if not np.any(kept[i] == tok):
            raise ValueError(f"request {out.request_id!r}: token {i} ({tok}) is not in its kept set")
        if tok not in c.logprobs[i]:
            raise ValueError(f"request {out.request_id!r}: token {i} ({tok}) has no logprob")
    if prompt_routes is not None and len(prompt_routes):
        recorder.add_prompt_routing(out.request_id, 0, prompt_routes.transpose(1, 0, 2))
    for i, tok in enumerate(toks):
        recorder.add(out.request_id, position=len(prompt) + i, index=i, version=versions[i], token_id=tok,
                     logprob=float(c.logprobs[i][tok].logprob), kept=kept[i],
                     routing=None if token_routes is None else token_routes[i])
    recorder.finish(out.request_id)
    return n
