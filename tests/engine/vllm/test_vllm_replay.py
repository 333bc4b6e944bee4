"""Replay records from a real vLLM (CPU) serving a tiny dense Qwen2, sampled through syncd's logits processor and
recorded inside the worker (``syncd.engine.vllm.kept``, ``syncd.engine.vllm.recording``):

* every recorded kept set (top-k and top-p at several temperatures, greedy) is the shared rule
  (``syncd.ops.replay.kept_sets``) on the trainer's own fp32 logits of the same weights, and holds the sampled
  token; each record's log-prob is the streamed one and the trainer's under the kept set;
* a request without replay is vLLM's own: its tokens equal those of a vLLM started without the processor (same
  seed), also when it shares batches with replay requests;
* a request spanning an update: the tokens after the apply carry the new version, and their kept sets and
  log-probs are the trainer's under the new weights, with the keys and values of the prefix from the old ones
  (segmented recomputation);
* bad replay settings are refused naming the field.

Two engines start in this module, one after the other: a plain vLLM (the baseline), then the recording one."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from syncd.engines.protocol import GenerationRequest, SamplingParams
from tests.engine.vllm.conftest import Trainer, write_tiny

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RUN = "vllm-replay"
SETTINGS = [dict(temperature=0.9, top_p=0.8, top_k=20), dict(temperature=1.0, top_p=0.5),
            dict(temperature=0.7, top_k=5), dict(temperature=1.3, top_p=0.95, top_k=100), dict(temperature=0.0)]
N = 24


def _prompt(i: int) -> tuple[int, ...]:
    return tuple((13 * i + 7 * j) % 250 + 1 for j in range(20 + i))


def _requests(prefix: str):
    return [GenerationRequest(f"{prefix}{i}", _prompt(i), SamplingParams(max_tokens=N, seed=100 + i, **sp))
            for i, sp in enumerate(SETTINGS)]


async def _run(eng, reqs, replay=None):
    async def one(r):
        return [ev async for ev in eng.generate(r, replay=replay)]
    return await asyncio.gather(*[one(r) for r in reqs])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny(tmp_path_factory, "qwen2", seed=5)


@pytest.fixture(scope="module")
def plain_tokens(model_dir):
    """Tokens of the requests (without replay) from a vLLM started without syncd's processor."""
    from syncd.engine.vllm import VLLMEngine

    with VLLMEngine(model_dir, version=0, max_model_len=512, max_num_seqs=8) as eng:
        evs = asyncio.run(_run(eng, _requests("plain")))
    return [[e.token_id for e in x] for x in evs]


@pytest.fixture(scope="module")
def setup(model_dir, plain_tokens, tmp_path_factory):
    from syncd.engine.vllm import ReplayConfig, VLLMEngine
    from syncd.store import Store

    store = tmp_path_factory.mktemp("replay-store")
    trainer = Trainer(model_dir, Store(tmp_path_factory.mktemp("replay-trainer")))
    eng = VLLMEngine(model_dir, version=0, max_model_len=512, max_num_seqs=8, replay=ReplayConfig(str(store), RUN))
    try:
        yield eng, trainer, store
    finally:
        eng.close()
        trainer.close()


def _records(store, rid):
    from syncd.engine.replay import read_request

    return [r for c in read_request(str(store), RUN, rid) for r in c.records]


def _check_against(records, logits, sp: SamplingParams, events=None):
    """Every record's kept set is the shared rule on ``logits`` (one row per record) and holds its token; its
    log-prob is the trainer's under the set (and the streamed one)."""
    from syncd.ops.replay import kept_sets

    for i, r in enumerate(records):
        assert r.token_id in r.kept
        if sp.temperature == 0:
            assert list(r.kept) == [r.token_id] and r.logprob == 0.0
            assert int(logits[i].argmax()) == r.token_id
            continue
        ks = kept_sets(logits[i][None], sp.temperature, sp.top_k, sp.top_p)
        assert np.array_equal(np.asarray(r.kept), np.sort(ks.ids.numpy())), i
        want = float(ks.logprobs[(ks.ids == r.token_id).nonzero()[0, 0]])
        assert r.logprob == pytest.approx(want, abs=1e-4)
    if events is not None:
        for r, e in zip(records, events):
            assert abs(r.logprob - e.logprob) <= 1e-5 * max(1.0, abs(r.logprob))


def test_kept_sets_are_the_shared_rule_on_the_trainers_logits(setup):
    eng, trainer, store = setup
    reqs = _requests("kept")
    evs = asyncio.run(_run(eng, reqs))
    stats = eng.flush_replay()
    assert stats["missing"] == 0 and stats["tokens"] >= len(reqs) * N
    model = trainer.hf_model(0)
    sizes = []
    for req, ev in zip(reqs, evs):
        recs = _records(store, req.request_id)
        P = len(req.prompt_token_ids)
        assert [(r.position, r.index, r.version, r.token_id) for r in recs] == \
            [(P + i, i, 0, e.token_id) for i, e in enumerate(ev)]
        seq = torch.tensor([list(req.prompt_token_ids) + [e.token_id for e in ev]])
        with torch.no_grad():
            logits = model(seq[:, :-1]).logits[0, P - 1:].float()
        _check_against(recs, logits, req.sampling, ev)
        sizes += [len(r.kept) for r in recs]
    assert min(sizes) == 1 and max(sizes) > 5  # greedy and small sets, and large ones


def test_a_request_without_replay_is_vllms_own(setup, plain_tokens):
    eng, _, store = setup
    mixed = _requests("mixed-replay")  # replay requests in the same batches
    evs = asyncio.run(_run(eng, _requests("own") + mixed[:2], replay=False)) + \
        asyncio.run(_run(eng, mixed[2:]))
    assert [[e.token_id for e in x] for x in evs[:len(SETTINGS)]] == plain_tokens
    eng.flush_replay()
    assert all(not _records(store, f"own{i}") for i in range(len(SETTINGS)))

    async def together():  # the same requests again, sharing batches with replay requests
        own = _run(eng, _requests("own-again"), replay=False)
        rep = _run(eng, _requests("rep-again"), replay=True)
        return await asyncio.gather(own, rep)

    own, rep = asyncio.run(together())
    assert [[e.token_id for e in x] for x in own] == plain_tokens
    eng.flush_replay()
    assert all(len(_records(store, f"rep-again{i}")) == N for i in range(len(SETTINGS)))


def test_bad_replay_settings_are_refused(setup):
    from syncd.engine.vllm.replay_config import check_request

    eng = setup[0]

    def refused(field, **sp):
        req = GenerationRequest(f"bad-{field}", (1, 2, 3), SamplingParams(max_tokens=2, **sp))
        with pytest.raises(ValueError, match=field):
            asyncio.run(_run(eng, [req]))

    refused("top_k", top_k=eng.vocab_size + 1)
    refused("top_p", top_p=1.5)
    refused("top_p", top_p=0.0)
    refused("temperature", temperature=1e-7)
    ok = GenerationRequest("ok", (1, 2, 3), SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="without a replay store"):
        check_request(ok, True, has_store=False, vocab_size=eng.vocab_size)
    assert check_request(ok, None, has_store=False, vocab_size=None) is False

    async def raw():  # straight to vLLM: its own top-p after the kept set is refused by the processor
        from vllm import SamplingParams as VSP

        sp = VSP(max_tokens=2, top_p=0.5, extra_args={"syncd_replay": {"request_id": "raw", "temperature": 1.0,
                                                                        "top_k": 0, "top_p": 0.5}})
        async for _ in eng.llm.generate({"prompt_token_ids": [1, 2, 3]}, sp, request_id="raw"):
            pass

    with pytest.raises(Exception, match="top_p/top_k to syncd"):
        eng.run(lambda llm: raw())


def test_a_mid_request_update_records_the_new_version_and_its_logprobs(setup):
    """Pause while two sampled requests run, apply, resume: their records carry each token's version, and the
    tokens after the apply have the kept sets and log-probs of the new weights over the old prefix's cache."""
    eng, trainer, store = setup
    old = eng.version
    new = trainer.step()
    eng.stage(trainer.update(new))
    sps = [SamplingParams(max_tokens=80, temperature=0.9, top_p=0.9, top_k=40, seed=7),
           SamplingParams(max_tokens=80, temperature=1.1, top_p=0.7, seed=8)]
    reqs = [GenerationRequest(f"span{i}", _prompt(30 + i), sp) for i, sp in enumerate(sps)]

    async def main():
        async def one(req, switch):
            evs = []
            async for ev in eng.generate(req):
                evs.append(ev)
                if switch and len(evs) == 20:
                    for op in (eng.pause, eng.apply, eng.resume):
                        await asyncio.to_thread(op)
            return evs
        return await asyncio.gather(one(reqs[0], True), one(reqs[1], False))

    evs = asyncio.run(main())
    eng.flush_replay()
    m_old, m_new = trainer.hf_model(old), trainer.hf_model(new)
    for req, ev in zip(reqs, evs):
        recs = _records(store, req.request_id)
        assert [r.version for r in recs] == [e.version for e in ev]
        k = next(i for i, r in enumerate(recs) if r.version == new)
        assert 0 < k < len(recs) - 8 and all(r.version == old for r in recs[:k])
        P = len(req.prompt_token_ids)
        seq = torch.tensor([list(req.prompt_token_ids) + [e.token_id for e in ev]])
        with torch.no_grad():  # tokens 0..k-1 from the old weights; the rest from the new over the old prefix's K/V
            out = m_old(seq[:, :P + k - 1], use_cache=True)
            before = out.logits[0, P - 1:].float()
            after = m_new(seq[:, P + k - 1:-1], past_key_values=out.past_key_values, use_cache=True).logits[0].float()
        _check_against(recs, torch.cat([before, after]), req.sampling, ev)
