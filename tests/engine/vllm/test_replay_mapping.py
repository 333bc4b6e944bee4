"""syncd.engine.vllm.replay on vLLM's own output classes (``vllm.outputs.RequestOutput``, ``CompletionOutput``,
``SamplingMask``, ``WeightVersionSpan``, ``vllm.logprobs.Logprob``, ``vllm.v1.outputs.SamplingMaskLists``) FILLED
BY THE TEST: on CPU vLLM cannot produce sampling masks or routed experts (they need Model Runner V2, i.e. a GPU),
so these objects stand in for what a GPU engine returns. The records go through the real ReplayRecorder into a
real file store and are read back."""

from __future__ import annotations

import os

import numpy as np
import pytest

from syncd.engine.replay import ReplayRecorder, read_request
from syncd.engine.vllm.replay import kept_sets, record_output, routes
from syncd.store import Store

if os.environ.get("SYNCD_VLLM") == "off":  # the one way to go without the extra; otherwise a broken vLLM fails
    pytest.skip("SYNCD_VLLM=off: the vllm extra is not installed on this machine", allow_module_level=True)

from vllm.logprobs import Logprob  # noqa: E402
from vllm.outputs import CompletionOutput, RequestOutput, SamplingMask, WeightVersionSpan  # noqa: E402
from vllm.v1.outputs import SamplingMaskLists  # noqa: E402

VOCAB, E, LAYERS, TOPK = 320, 8, 2, 2


def _output(prompt, toks, kept, versions, routed=None, rid="req-1"):
    lps = [{t: Logprob(logprob=-0.25 * (i + 1), rank=1)} for i, t in enumerate(toks)]
    c = CompletionOutput(index=0, text="", token_ids=toks, cumulative_logprob=None, logprobs=lps,
                         routed_experts=routed, finish_reason="length", sampling_mask=SamplingMask(kept),
                         weight_versions=versions)
    return RequestOutput(rid, prompt=None, prompt_token_ids=prompt, prompt_logprobs=None, outputs=[c], finished=True)


def test_moe_output_maps_onto_replay_records(tmp_path):
    rng = np.random.default_rng(0)
    prompt, toks = [257, 10, 11, 12], [40, 41, 42, 43, 44]
    kept = [[t, t + 7, t - 3] for t in toks]  # unsorted, as the engine may list them
    routed = rng.integers(0, E, (len(prompt) + len(toks) - 1, LAYERS, TOPK)).astype(np.uint8)  # vLLM: uint8 <= 256
    spans = [WeightVersionSpan("3", 0, 2), WeightVersionSpan("4", 2, 5)]
    rec = ReplayRecorder(Store(tmp_path / "store"), "run", vocab_size=VOCAB, num_experts=E)
    assert record_output(rec, _output(prompt, toks, kept, spans, routed), num_experts=E) == 5
    rec.close()
    [chunk] = read_request(Store(tmp_path / "store"), "run", "req-1")
    got = chunk.records
    assert [(r.position, r.index, r.version, r.token_id) for r in got] == \
        [(4 + i, i, 3 if i < 2 else 4, t) for i, t in enumerate(toks)]
    assert np.allclose([r.logprob for r in got], [-0.25 * (i + 1) for i in range(5)])
    for r, k in zip(got, kept):
        assert list(r.kept) == sorted(k)
    for i, r in enumerate(got):  # token i was sampled from the logits at position P + i - 1
        assert np.array_equal(r.routing, routed[len(prompt) + i - 1].astype(np.int16))
    assert chunk.prompt_routing_start == 0 and np.array_equal(chunk.prompt_routing, routed[:len(prompt) - 1])


def test_csr_sampling_masks_and_bad_outputs():
    flat, offsets = np.array([5, 1, 9, 2, 3]), np.array([0, 3, 3, 5])
    sets = kept_sets(SamplingMaskLists(flat, offsets), 3)
    assert [list(s) for s in sets] == [[1, 5, 9], [], [2, 3]]
    assert [list(s) for s in kept_sets(SamplingMaskLists(np.array([4, 2])), 1)] == [[2, 4]]  # one position
    with pytest.raises(ValueError, match="offsets"):
        kept_sets(SamplingMaskLists(flat, np.array([0, 3, 5])), 3)
    with pytest.raises(ValueError, match="expected"):
        routes(np.zeros((3, LAYERS, TOPK), np.uint8), 4, 2, E)
    with pytest.raises(ValueError, match="outside"):
        routes(np.full((5, LAYERS, TOPK), E, np.uint8), 4, 2, E)

    prompt, toks = [1, 2], [3, 4]
    bad_kept = _output(prompt, toks, [[3], [5]], [WeightVersionSpan("1", 0, 2)])
    gaps = _output(prompt, toks, [[3], [4]], [WeightVersionSpan("1", 0, 1)])
    for out, match in ((bad_kept, "not in its kept set"), (gaps, "cover 1 tokens")):
        sink = _Sink()
        with pytest.raises(ValueError, match=match):
            record_output(sink, out)
        assert sink.added == []  # refused whole, nothing half recorded
    no_mask = _output(prompt, toks, [[3], [4]], [WeightVersionSpan("1", 0, 2)])
    no_mask.outputs[0].sampling_mask = None
    with pytest.raises(ValueError, match="Model Runner V2"):
        record_output(_Sink(), no_mask)
    with pytest.raises(ValueError, match="routed_experts"):
        record_output(_Sink(), _output(prompt, toks, [[3], [4]], [WeightVersionSpan("1", 0, 2)]), num_experts=E)


class _Sink:
    """A recorder stand-in that only collects (for the refusals, which must raise before anything is kept)."""

    def __init__(self):
        self.added = []

    def add(self, *a, **kw):
        self.added.append(kw)

    def add_prompt_routing(self, *a):
        self.added.append(a)

    def finish(self, rid):
        pass
