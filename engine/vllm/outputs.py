"""vLLM's request side in syncd's terms: :func:`sampling_params` (our ``SamplingParams`` as vLLM's, for a replay
request with top-k/top-p left to syncd's logits processor) and :func:`token_versions` (the weight version of each
streamed token).

vLLM labels tokens with its weight version per engine step, but hands the spans
(``CompletionOutput.weight_versions``, ``[WeightVersionSpan(version, start, end)]``) out only on a request's
final output. A streamed token's version is read from the same place vLLM builds those spans from, the output
processor's per-request ``weight_version_starts``, which is complete for every token already delivered
(tokens are labelled before their output is queued). It is vLLM-private state: where it is missing the
engine's current version is used, and the final spans are what the replay records trust
(:mod:`syncd.engine.vllm.replay`).
"""

from __future__ import annotations

import bisect

from syncd.engines.protocol import SamplingParams

__all__ = ["sampling_params", "token_versions", "spans_to_versions"]


def sampling_params(sp: SamplingParams, *, replay_id: str | None = None):
    """vLLM's ``SamplingParams`` for ours: the same temperature/top-p/top-k/seed, stop only at
    ``stop_token_ids`` (EOS is not special, as in the reference engine), the sampled token's logprob, token
    deltas (no detokenization). With ``replay_id`` (the request's syncd id) the request is recorded: vLLM's
    top-p/top-k are off and ours travel in ``extra_args`` to :class:`syncd.engine.vllm.kept.SyncdKeptSets`, which
    applies them (the shared rule) and masks the rest."""
    from vllm import SamplingParams as VSP
    from vllm.sampling_params import RequestOutputKind

    top_p, top_k, extra = sp.top_p, sp.top_k if sp.top_k > 0 else 0, None
    if replay_id is not None:
        from syncd.engine.vllm.kept import EXTRA_KEY, ReplayArgs

        extra = {EXTRA_KEY: ReplayArgs(replay_id, float(sp.temperature), top_k, float(top_p)).to_extra()}
        top_p, top_k = 1.0, 0
    return VSP(n=1, max_tokens=sp.max_tokens, temperature=sp.temperature, top_p=top_p, top_k=top_k, seed=sp.seed,
               stop_token_ids=list(sp.stop_token_ids), ignore_eos=True, logprobs=0,
               output_kind=RequestOutputKind.DELTA, detokenize=False, extra_args=extra)


def spans_to_versions(spans, n: int) -> list[int | None]:
    """Per-token versions of ``n`` output tokens from vLLM's ``weight_versions`` spans (str labels of syncd's int
    versions; ``"default"`` or another non-integer label is None). Raises ValueError for spans that do not
    cover ``0..n`` contiguously."""
    out: list[int | None] = []
    for s in spans or ():
        if s.start != len(out) or s.end < s.start:
            raise ValueError(f"weight_versions spans are not contiguous at {s!r} (covered {len(out)})")
        out.extend([_int(s.version)] * (s.end - s.start))
    if len(out) != n:
        raise ValueError(f"weight_versions spans cover {len(out)} tokens, the output has {n}")
    return out


def _int(label):
    try:
        return int(label)
    except (TypeError, ValueError):
        return None


def token_versions(llm, request_id: str, completion, start: int, n: int, *, fallback):
    """Versions of the ``n`` tokens ``start..start+n`` of a streamed (delta) ``completion`` of ``request_id``."""
    spans = completion.weight_versions
    if spans is not None:  # the final output: vLLM's own spans over every token
        total = spans[-1].end if spans else 0
        return spans_to_versions(spans, total)[start:start + n] if total >= start + n else [fallback] * n
    try:
        op = llm.output_processor
        states = [op.request_states[i] for i in op.external_req_ids.get(request_id, ())]
        starts = states[0].weight_version_starts if states else None
    except (AttributeError, KeyError, IndexError):
        starts = None
    if not starts:
        return [fallback] * n
    at = [s for _, s in starts]
    return [_int(starts[bisect.bisect_right(at, i) - 1][0]) if i >= at[0] else fallback
            for i in range(start, start + n)]
