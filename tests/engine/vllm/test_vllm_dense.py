"""A real vLLM (CPU) serving a tiny Qwen2 (dense, fused qkv and gate_up) takes syncd's updates in place while it
serves. One engine for the module; the tests run in order and each leaves it on the trainer's newest version.

* the node daemon follows a run a real trainer publishes (AdamW steps, ``WeightPublisher``) while requests
  stream: after every apply vLLM's parameters equal the trainer's bit for bit (checksums on the worker), no
  request is aborted, and tokens after an apply carry the new version (streamed and in vLLM's spans);
* the KV cache is kept: a request that spans an update continues exactly as a recomputation whose prefix keeps
  the old weights' keys and values, not as one that recomputes them, and a repeated prompt hits vLLM's prefix
  cache after the update;
* a corrupt delta, a wrong base version and a forged manifest leave vLLM serving the weights it had;
* rollback and load_full, as for the reference engine.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest
import torch

from syncd import manifest as mf
from syncd.engines.params import expected_checksums
from syncd.engines.protocol import GenerationRequest, SamplingParams
from syncd.engines.update import Update
from syncd.errors import DeltaError
from tests.engine.vllm.conftest import KEY, RUN, engine_and_trainer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPT = tuple(range(40, 80))  # 40 tokens: more than one 32-token KV block
_fresh = iter(range(1000))


def fresh_prompt(n=40) -> list[int]:
    """A prompt no earlier request shares a KV block with: vLLM's prefix cache is kept across updates
    (``clear_cache=False``), so a repeated prompt would reuse keys and values of older weights."""
    i = next(_fresh)
    return [(7 * i + j) % 250 + 1 for j in range(n)][::-1] if i % 2 else [(11 * i + 3 * j) % 250 + 1 for j in range(n)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    yield from engine_and_trainer(tmp_path_factory, "qwen2", seed=3)


def _bit_exact(eng, trainer, version):
    assert eng.version == version
    assert eng.checksum() == expected_checksums(eng.parameters(), trainer.snaps[version])


async def _collect(eng, rid, prompt, **sp):
    return [ev async for ev in eng.generate(GenerationRequest(rid, tuple(prompt), SamplingParams(**sp)))]


def _greedy(eng, rid, prompt, n=8):
    return asyncio.run(_collect(eng, rid, prompt, max_tokens=n, temperature=0.0))


def test_layout_and_start_checksums(setup):
    eng, trainer = setup
    names = {s.name for s in eng.parameters()}
    assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.layers.1.mlp.gate_up_proj.weight" in names
    qkv = next(s for s in eng.parameters() if s.name == "model.layers.0.self_attn.qkv_proj.bias")
    assert [p.source.rsplit(".", 2)[1] for p in qkv.pieces] == ["q_proj", "k_proj", "v_proj"]
    _bit_exact(eng, trainer, 0)
    evs = _greedy(eng, "start", PROMPT)
    assert [e.version for e in evs] == [0] * 8 and evs[-1].finish_reason == "length"


def test_daemon_keeps_vllm_current_while_it_serves(setup, tmp_path):
    from syncd.daemon import DaemonConfig, NodeDaemon

    eng, trainer = setup
    n_updates, n_long, long_tokens = 3, 4, 400
    cfg = DaemonConfig(run_id=RUN, cache_dir=tmp_path / "cache", poll_interval_s=0.05, engine_check_s=0.2)
    after: dict[int, list] = {}

    async def main():
        d = NodeDaemon(cfg, adapters={"vllm": eng}, store=trainer.store, signing_key=KEY)
        task = asyncio.ensure_future(d.run())
        try:
            streams = [asyncio.ensure_future(_collect(eng, f"long{i}", (257, 40 + i, 41, 42), max_tokens=long_tokens,
                                                      temperature=1.0, top_p=0.9, seed=i)) for i in range(n_long)]
            while len(after) < n_updates and not all(s.done() for s in streams):
                v = await asyncio.to_thread(trainer.step)
                t0 = time.monotonic()
                while eng.version != v:
                    assert time.monotonic() - t0 < 120, f"the daemon did not bring vLLM to version {v}"
                    assert not task.done(), task
                    await asyncio.sleep(0.02)
                got = await asyncio.to_thread(eng.checksum)  # bit-exact after every apply (on the worker)
                assert got == expected_checksums(eng.parameters(), trainer.snaps[v]), v
                after[v] = await _collect(eng, f"after{v}", (257, 60, 61), max_tokens=4, temperature=0.0)
            return await asyncio.gather(*streams)
        finally:
            d.request_stop()
            await task

    longs = asyncio.run(main())
    assert sorted(after) == list(range(1, n_updates + 1)), "requests finished before the updates were done"
    for v, evs in after.items():  # a request started after the apply runs on the new weights only
        assert [e.version for e in evs] == [v] * 4
    spanned = 0
    for evs in longs:
        assert [e.index for e in evs] == list(range(long_tokens))  # nothing dropped, restarted or aborted
        assert evs[-1].finish_reason == "length" and all(e.finish_reason is None for e in evs[:-1])
        versions = [e.version for e in evs]
        assert versions == sorted(versions) and versions[0] == 0
        spanned += len(set(versions)) > 1
    assert spanned, "no request was in flight across an update"


def test_kv_cache_kept_across_an_update(setup):
    """Pause while a greedy request runs, apply, resume: its continuation must equal a recomputation with the
    old weights' K/V for the prefix (the cache vLLM kept) and the new weights after, and differ from one that
    recomputes the prefix on the new weights. The repeated prompt then hits vLLM's prefix cache."""
    eng, trainer = setup
    old = eng.version
    new = trainer.step()
    eng.stage(trainer.update(new))  # while serving: nothing running yet, but nothing paused either
    prompt = fresh_prompt()
    n, switch_at = 96, 24

    async def main():
        gen = eng.generate(GenerationRequest("kv", tuple(prompt), SamplingParams(max_tokens=n, temperature=0.0)))
        evs = []
        async for ev in gen:
            evs.append(ev)
            if len(evs) == switch_at:
                await asyncio.to_thread(eng.pause)
                await asyncio.to_thread(eng.apply)
                await asyncio.to_thread(eng.resume)
        return evs

    evs = asyncio.run(main())
    _bit_exact(eng, trainer, new)
    # every touched linear layer's packed copy was built while staging and swapped in, none packed in the pause
    linear = [s for s in eng.parameters() if len(s.shape) == 2]  # the projections and the (tied) lm_head
    assert eng.last_write["swapped"] == len(linear) > 0 and eng.last_write["rebuilt"] == 0
    toks = [e.token_id for e in evs]
    k = next(i for i, e in enumerate(evs) if e.version == new)
    assert switch_at <= k < n - 8 and all(e.version == old for e in evs[:k]) and all(e.version == new for e in evs[k:])
    m_old, m_new = trainer.hf_model(old), trainer.hf_model(new)
    lps = torch.tensor([e.logprob for e in evs], dtype=torch.float64)  # vLLM's logprob of each token it sampled
    seq = torch.tensor([prompt + toks])
    P = len(prompt)
    with torch.no_grad():  # teacher-forced on vLLM's own tokens, so near-ties of a random model do not matter
        def logprobs(logits, first):
            lp = torch.log_softmax(logits[0].double(), -1)
            return lp[torch.arange(lp.shape[0]), seq[0, first + 1:first + 1 + lp.shape[0]]]

        before = logprobs(m_old(seq[:, :P + k - 1]).logits[:, P - 1:], P - 1)  # tokens 0..k-1: old weights
        cache = m_old(seq[:, :P + k - 1], use_cache=True).past_key_values  # the prefix's K/V from the old weights
        kept = logprobs(m_new(seq[:, P + k - 1:-1], past_key_values=cache, use_cache=True).logits, P + k - 1)
        recomputed = logprobs(m_new(seq[:, :-1]).logits[:, P + k - 1:], P + k - 1)  # K/V recomputed on new weights
    tol = 1e-4  # float32 kernels of vLLM (oneDNN) against transformers: ~1e-6 here
    assert (lps[:k] - before).abs().max() < tol
    assert (lps[k:] - kept).abs().max() < tol
    assert (lps[k:] - recomputed).abs().max() > 10 * tol  # so the cache was kept, not recomputed

    async def again():
        from syncd.engine.vllm.outputs import sampling_params

        final = None
        async for out in eng.llm.generate({"prompt_token_ids": prompt},
                                          sampling_params(SamplingParams(max_tokens=2, temperature=0.0)),
                                          request_id="again"):
            final = out
        return final.num_cached_tokens

    assert eng.run(lambda llm: again()) >= 32  # the prompt's first KV block, computed before the update


def test_bad_input_leaves_the_served_weights(setup, tmp_path):
    from syncd.daemon import DaemonConfig, NodeDaemon
    from syncd.signing import SigningKey
    from syncd.versions import read_manifest

    eng, trainer = setup
    v = eng.version
    before = eng.checksum()
    reference = [e.token_id for e in _greedy(eng, "ref", PROMPT, 12)]

    # a forged manifest (signed with another key) as the newest version: the daemon never hands it to vLLM
    m = read_manifest(trainer.store, RUN, v, signing_key=KEY)
    moved = tuple(replace(sh, key=sh.key.replace(mf.version_dir(v), mf.version_dir(v + 1))) for sh in m.shards)
    forged = replace(m, version=v + 1, shards=moved)
    trainer.store.put(mf.manifest_key(RUN, v + 1), forged.encode(SigningKey(b"attacker-key-0123456789abcdef")))
    cfg = DaemonConfig(run_id=RUN, cache_dir=tmp_path / "cache", poll_interval_s=0.05, engine_check_s=0.1)

    async def follow():
        d = NodeDaemon(cfg, adapters={"vllm": eng}, store=trainer.store, signing_key=KEY)
        task = asyncio.ensure_future(d.run())
        try:
            t0 = time.monotonic()
            while d.manifests.rejected(v + 1) is None:
                assert time.monotonic() - t0 < 60, "the daemon never read the forged manifest"
                await asyncio.sleep(0.05)
            assert "signature" in d.manifests.rejected(v + 1).lower()
            await asyncio.sleep(0.5)  # and more polls, rounds and engine checks after it
        finally:
            d.request_stop()
            await task

    asyncio.run(follow())
    assert eng.version == v and eng.checksum() == before
    assert [e.token_id for e in _greedy(eng, "after-forged", PROMPT, 12)] == reference
    trainer.store.delete(mf.manifest_key(RUN, v + 1))  # the trainer's next version takes its place

    # a corrupt delta blob and a wrong base version are refused by stage, before anything is written
    nxt = trainer.step()
    good = trainer.update(nxt)
    name = max(good.tensors, key=lambda n: len(good.tensors[n]))
    blob = bytearray(good.tensors[name])
    blob[len(blob) // 2] ^= 0x40
    with pytest.raises(DeltaError):
        eng.stage(Update(nxt, "delta", dict(good.tensors, **{name: bytes(blob)}), v, good.checksums))
    with pytest.raises(ValueError, match=f"base version {v - 1}"):
        eng.stage(Update(nxt, "delta", good.tensors, v - 1, good.checksums))
    eng.pause()
    with pytest.raises(RuntimeError, match="staged"):  # nothing valid was staged
        eng.apply()
    eng.resume()
    assert eng.version == v and eng.checksum() == before
    evs = _greedy(eng, "after-bad", PROMPT, 12)
    assert [e.token_id for e in evs] == reference and {e.version for e in evs} == {v}

    eng.stage(good)  # and the genuine version still applies
    eng.pause()
    eng.apply()
    eng.resume()
    _bit_exact(eng, trainer, nxt)


def test_rollback_and_load_full(setup):
    eng, trainer = setup
    v = eng.version
    nxt = trainer.step()
    eng.stage(trainer.update(nxt))
    eng.pause()
    eng.apply()
    _bit_exact(eng, trainer, nxt)
    eng.rollback()
    eng.resume()
    _bit_exact(eng, trainer, v)
    assert {e.version for e in _greedy(eng, "rolled-back", PROMPT, 4)} == {v}
    eng.pause()
    eng.load_full(trainer.update(0))  # version 0 is the run's full version
    eng.resume()
    _bit_exact(eng, trainer, 0)
    prompt = fresh_prompt()
    evs = _greedy(eng, "full", prompt, 12)
    seq = torch.tensor([prompt + [e.token_id for e in evs]])
    with torch.no_grad():
        lp = torch.log_softmax(trainer.hf_model(0)(seq[:, :-1]).logits[0, len(prompt) - 1:].double(), -1)
    want = lp[torch.arange(12), seq[0, len(prompt):]]
    assert (torch.tensor([e.logprob for e in evs], dtype=torch.float64) - want).abs().max() < 1e-4
    assert {e.version for e in _greedy(eng, "full2", PROMPT, 2)} == {0}
