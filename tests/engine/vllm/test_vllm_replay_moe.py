"""Routes recorded inside a real vLLM (CPU) serving a tiny Qwen3-MoE (8 experts, top-2): every position a request
ran, prompt and generated, carries the experts each MoE layer chose (vLLM's router capture hook, cut by the batch
layout of each forward), and replaying them in the trainer's forward (``syncd.trainer.rl.replay.routing_replay``)
gives a routing disagreement of 0 -- with the prompts prefilled in chunks (a 64-token step budget), with requests
preempted and recomputed (a KV cache of 17 blocks for more), and for a request that spans an update (its tokens
after the apply replayed on the new weights over the old prefix's keys and values). Kept sets and log-probs are
checked as on the dense model."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from syncd.engines.protocol import GenerationRequest, SamplingParams
from tests.engine.vllm.conftest import engine_and_trainer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RUN = "vllm-moe-replay"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from syncd.engine.vllm import ReplayConfig

    store = tmp_path_factory.mktemp("moe-replay-store")
    # a 64-token step budget chunks every longer prompt; 17 KV blocks of 32 tokens (one 512-token request) preempt
    # concurrent ones
    kwargs = dict(max_num_batched_tokens=64, enable_chunked_prefill=True, num_gpu_blocks_override=17)
    for eng, trainer in engine_and_trainer(tmp_path_factory, "qwen3_moe", seed=6, cpu_gemm="torch",
                                           replay=ReplayConfig(str(store), RUN), engine_kwargs=kwargs):
        yield eng, trainer, store


def _read(store, rid):
    from syncd.engine.replay import read_request

    chunks = read_request(str(store), RUN, rid)
    recs = [r for c in chunks for r in c.records]
    prompt = chunks[0].prompt_routing
    assert chunks[0].prompt_routing_start == 0 and all(c.prompt_routing is None for c in chunks[1:])
    return recs, np.concatenate([prompt, np.stack([r.routing for r in recs])])  # routes of positions 0..T-2


def _replayed(model, seq, routes, **kw):
    """``model`` over ``seq`` under the recorded ``routes``: (logits, disagreement, routed pairs)."""
    from syncd.trainer.rl.replay import routing_replay

    with torch.no_grad(), routing_replay(model, torch.as_tensor(routes)) as rr:
        out = model(seq, use_cache=True, **kw)
    return out, rr.disagreement, rr.routed_pairs


def _kept_ok(recs, logits, sp):
    from syncd.ops.replay import kept_sets

    for i, r in enumerate(recs):
        ks = kept_sets(logits[i][None].float(), sp.temperature, sp.top_k, sp.top_p)
        assert np.array_equal(np.asarray(r.kept), np.sort(ks.ids.numpy())) and r.token_id in r.kept, i


def test_routes_replay_with_chunked_prefill_and_preemption(setup):
    eng, trainer, store = setup
    # seeded, as the Dynamo worker seeds every request: vLLM 0.32 alone would die on the chunked prompt (see
    # syncd.engine.vllm.cpu_seeded_chunks)
    prompts = [tuple((5 * i + 3 * j) % 250 + 1 for j in range(150 if i == 0 else 40)) for i in range(4)]
    reqs = [GenerationRequest(f"moe{i}", p, SamplingParams(max_tokens=120, temperature=1.0, top_p=0.9, top_k=30,
                                                           seed=i)) for i, p in enumerate(prompts)]

    async def run():
        async def one(r):
            return [ev async for ev in eng.generate(r)]
        return await asyncio.gather(*[one(r) for r in reqs])

    evs = asyncio.run(run())
    stats = eng.flush_replay()
    assert stats["missing"] == 0 and stats["moe_layers"] == 2
    assert stats["recomputed"] > 0, "no request was preempted and recomputed"
    model = trainer.hf_model(0)
    for req, ev in zip(reqs, evs):
        recs, routes = _read(store, req.request_id)
        assert [r.token_id for r in recs] == [e.token_id for e in ev] and len(recs) == 120
        seq = torch.tensor([list(req.prompt_token_ids) + [e.token_id for e in ev]])
        out, disagreement, pairs = _replayed(model, seq[:, :-1], routes)
        assert disagreement == 0 and pairs == 2 * (seq.shape[1] - 1)
        _kept_ok(recs, out.logits[0, len(req.prompt_token_ids) - 1:], req.sampling)
    assert stats["route_conflicts"] == 0  # the recomputes routed as the first runs did


def test_routes_of_a_request_spanning_an_update(setup):
    eng, trainer, store = setup
    old = eng.version
    new = trainer.step()
    eng.stage(trainer.update(new))
    req = GenerationRequest("moe-span", tuple((7 * j) % 250 + 2 for j in range(70)),
                            SamplingParams(max_tokens=60, temperature=0.8, top_p=0.8, seed=11))

    async def run():
        evs = []
        async for ev in eng.generate(req):
            evs.append(ev)
            if len(evs) == 15:
                for op in (eng.pause, eng.apply, eng.resume):
                    await asyncio.to_thread(op)
        return evs

    ev = asyncio.run(run())
    eng.flush_replay()
    recs, routes = _read(store, req.request_id)
    assert [r.version for r in recs] == [e.version for e in ev]
    k = next(i for i, r in enumerate(recs) if r.version == new)
    assert 0 < k < len(recs) - 5 and all(r.version == old for r in recs[:k])
    P = len(req.prompt_token_ids)
    seq = torch.tensor([list(req.prompt_token_ids) + [e.token_id for e in ev]])
    cut = P + k - 1  # positions 0..cut-1 ran on the old weights; from cut on, the new ones over their K/V
    before, d0, n0 = _replayed(trainer.hf_model(old), seq[:, :cut], routes[:cut])
    after, d1, n1 = _replayed(trainer.hf_model(new), seq[:, cut:-1], routes[cut:],
                              past_key_values=before.past_key_values)
    assert d0 == 0 and d1 == 0 and n0 + n1 == 2 * (seq.shape[1] - 1)
    _kept_ok(recs, torch.cat([before.logits[0, P - 1:], after.logits[0]]), req.sampling)
