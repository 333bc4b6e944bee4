"""syncd.engine.reference.ReferenceEngine: continuous batching, sampling, determinism, migration, stop/abort, pause
semantics, the tensor-parallel split, MoE routing capture, and the tiny-model script."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest
import torch

from syncd.engines.protocol import Adapter, GenerationRequest, Generator, SamplingParams
from syncd.engines.update import Update
from syncd.engine.reference import ReferenceEngine
from syncd.engine.reference.make_tiny import main as make_tiny_main
from syncd.engine.reference.make_tiny import special_ids
from syncd.engine.reference.model import HFRunner, load_folder_weights
from syncd.engine.reference.sampling import kept_set, sample
from syncd.engines.params import expected_checksums
from syncd.ops import checksum, delta

PROMPT = (257, 84, 82, 68, 81, 198, 71)
SP = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=50, seed=11)


def _tokens(events):
    return [e.token_id for e in events if e.finish_reason != "abort"]


@pytest.fixture(scope="module")
def engine(dense_dir):
    eng = ReferenceEngine.from_pretrained(dense_dir, max_batch=3)
    yield eng
    eng.close()


def test_implements_adapter_and_generator(engine, dense_dir):
    assert isinstance(engine, Adapter) and isinstance(engine, Generator)
    assert engine.version == 0
    assert engine.checksum() == {k: checksum(v) for k, v in load_folder_weights(dense_dir).items()}


def test_same_seed_same_tokens_whatever_else_runs(engine):
    alone = engine.generate_sync(GenerationRequest("alone", PROMPT, SP), timeout=60)
    assert len(alone) == 10 and alone[-1].finish_reason == "length"
    assert [e.index for e in alone] == list(range(10))

    async def crowd():
        async def one(i, sp):
            prompt = PROMPT if i == 99 else PROMPT[: 3 + i % 4]
            return [e async for e in engine.generate(GenerationRequest(f"c{i}", prompt, sp))]
        reqs = [one(i, SamplingParams(max_tokens=4 + i, temperature=1.0, seed=i)) for i in range(6)]
        reqs.insert(3, one(99, SP))
        return await asyncio.gather(*reqs)

    results = asyncio.run(crowd())
    same = [r for r in results if r[0].request_id == "c99"][0]
    assert _tokens(same) == _tokens(alone)
    assert all(r[-1].finish_reason == "length" for r in results)
    assert engine.stats.steps > 0


def test_prompt_with_generated_tokens_continues_exactly(engine):
    full = engine.generate_sync(GenerationRequest("orig", PROMPT, SP), timeout=60)
    toks = _tokens(full)
    for k in (1, 4, 9):
        sp = SamplingParams(max_tokens=10 - k, temperature=SP.temperature, top_p=SP.top_p, top_k=SP.top_k, seed=SP.seed)
        rest = engine.generate_sync(GenerationRequest(f"mig{k}", PROMPT + tuple(toks[:k]), sp), timeout=60)
        assert _tokens(rest) == toks[k:]
        assert [e.index for e in rest] == list(range(10 - k))


def test_stop_tokens_greedy_and_abort(engine):
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    g = engine.generate_sync(GenerationRequest("g", PROMPT, greedy), timeout=60)
    assert all(e.logprob == 0.0 for e in g)
    stop_at = g[2].token_id
    first = [e.token_id for e in g].index(stop_at)
    s = engine.generate_sync(GenerationRequest("s", PROMPT, SamplingParams(max_tokens=6, temperature=0.0,
                                                                           stop_token_ids=(stop_at,))), timeout=60)
    assert [e.token_id for e in s] == [e.token_id for e in g][:first + 1] and s[-1].finish_reason == "stop"

    async def aborted():
        got = []
        async for ev in engine.generate(GenerationRequest("ab", PROMPT, SamplingParams(max_tokens=500, seed=1))):
            got.append(ev)
            if len(got) == 3:
                engine.abort("ab")
        return got

    got = asyncio.run(asyncio.wait_for(aborted(), 60))
    assert got[-1].finish_reason == "abort" and got[-1].token_id == -1 and len(got) < 500
    engine.abort("no-such-request")  # ignored


def test_bad_requests_are_refused(engine):
    for req, msg in [(GenerationRequest("e", ()), "empty"), (GenerationRequest("v", (1, 10_000)), "vocabulary"),
                     (GenerationRequest("m", (1,), SamplingParams(max_tokens=0)), "max_tokens"),
                     (GenerationRequest("p", (1,), SamplingParams(top_p=0.0)), "top_p")]:
        with pytest.raises(ValueError, match=msg):
            engine.submit(req, lambda ev: None)


def test_pause_holds_steps_queues_new_requests_and_keeps_caches(dense_dir):
    w = load_folder_weights(dense_dir)
    eng = ReferenceEngine.from_pretrained(dense_dir, version=5)
    try:
        events, started, finished = [], threading.Event(), threading.Event()

        def sink(ev):
            events.append(ev)
            started.set()
            if ev.finish_reason:
                finished.set()

        n_tokens = 400  # far more than run in the moment before the pause on a slow machine
        eng.submit(GenerationRequest("long", PROMPT, SamplingParams(max_tokens=n_tokens, seed=3)), sink)
        assert started.wait(30)
        with pytest.raises(RuntimeError, match="paused"):
            eng.apply()  # not paused
        eng.pause()
        n = len(events)
        assert 0 < n < n_tokens
        late, late_done = [], threading.Event()
        eng.submit(GenerationRequest("late", PROMPT, SamplingParams(max_tokens=3, seed=3)),
                   lambda ev: (late.append(ev), ev.finish_reason and late_done.set()))
        # a full version with every matrix nudged by one ulp, applied while paused
        new = {k: (v.view(torch.int16) + 1).view(torch.bfloat16) if v.dim() == 2 else v.clone() for k, v in w.items()}
        eng.stage(Update(6, "full", new))
        assert len(events) == n and late == []  # paused: no step ran, the new request waits
        eng.apply()
        assert eng.version == 6 and eng.checksum()["lm_head.weight"] == checksum(new["lm_head.weight"])
        eng.resume()
        assert finished.wait(60) and late_done.wait(60)
        assert [e.index for e in events] == list(range(n_tokens))  # nothing restarted or dropped
        assert {e.version for e in events[:n]} == {5} and {e.version for e in events[n:]} == {6}
        assert [e.version for e in late] == [6, 6, 6]
    finally:
        eng.close()


def test_sampling_kept_set_and_logprob():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.5, -3.0, 1.0])
    ids, logp = kept_set(logits, SamplingParams(temperature=1.0, top_p=0.75))
    probs = torch.softmax(logits, 0)
    assert ids.tolist() == [0, 1, 5]  # ties broken by id; smallest prefix with mass >= 0.75
    assert float(probs[[0, 1]].sum()) < 0.75 <= float(probs[[0, 1, 5]].sum())
    assert torch.allclose(logp.exp().sum(), torch.tensor(1.0))
    ids_k, _ = kept_set(logits, SamplingParams(temperature=1.0, top_k=2))
    assert ids_k.tolist() == [0, 1]
    s = sample(logits, SamplingParams(temperature=1.0, top_p=0.75), seed=1, position=7)
    assert s.token_id in (0, 1, 5) and s.kept.tolist() == [0, 1, 5]
    again = sample(logits, SamplingParams(temperature=1.0, top_p=0.75), seed=1, position=7)
    assert (again.token_id, again.logprob) == (s.token_id, s.logprob)
    assert abs(s.logprob - float(torch.log(probs[s.token_id] / probs[[0, 1, 5]].sum()))) < 1e-6
    draws = {sample(logits, SamplingParams(temperature=1.0), seed=1, position=p).token_id for p in range(200)}
    assert len(draws) >= 4


def test_tensor_parallel_ranks_match_the_full_model_through_real_deltas(dense_dir):
    from transformers import AutoConfig

    from tests.store._models import train_steps

    cfg = AutoConfig.from_pretrained(str(dense_dir))
    w0 = load_folder_weights(dense_dir)
    from transformers import AutoModelForCausalLM
    trainer = AutoModelForCausalLM.from_pretrained(str(dense_dir), dtype=torch.float32)
    snaps = [w0]
    train_steps(trainer, 2, lr=1e-3, callback=lambda s, m: snaps.append(
        {k: v.detach().to(torch.bfloat16) for k, v in m.state_dict().items()}))
    tp = ReferenceEngine.from_state_dict(w0, cfg, tp_size=2)
    try:
        assert {s.name.split(".", 1)[0] for s in tp.parameters()} == {"tp0", "tp1"}
        assert any(s.name.endswith("qkv_proj.weight") and len(s.pieces) == 3 for s in tp.parameters())
        for v in (1, 2):
            upd = Update(v, "delta", {k: delta.encode(snaps[v - 1][k], snaps[v][k]) for k in w0}, base_version=v - 1)
            tp.stage(upd)
            tp.pause()
            tp.apply()
            assert tp.checksum() == expected_checksums(tp.parameters(), snaps[v])
            tp.resume()
            hf_v = HFRunner(cfg, snaps[v])
            for runner in (hf_v,):
                c1, c2 = runner.new_cache(), tp.runner.new_cache()
                for feed in ([1, 2, 3, 4], [9], [200]):
                    assert torch.allclose(runner.forward(c1, feed)[0], tp.runner.forward(c2, feed)[0], atol=1e-5)
        greedy = SamplingParams(max_tokens=8, temperature=0.0)
        ref = ReferenceEngine(HFRunner(cfg, snaps[2]), version=2)
        try:
            assert (_tokens(tp.generate_sync(GenerationRequest("t", PROMPT, greedy), timeout=60))
                    == _tokens(ref.generate_sync(GenerationRequest("t", PROMPT, greedy), timeout=60)))
        finally:
            ref.close()
    finally:
        tp.close()


def test_moe_engine_captures_the_routers_choice(moe_dir):
    eng = ReferenceEngine.from_pretrained(moe_dir)
    try:
        assert eng.runner.moe_layers == 2 and eng.runner.top_k == 2 and eng.runner.num_experts == 8
        cache = eng.runner.new_cache()
        logits, routing = eng.runner.forward(cache, list(PROMPT))
        assert routing.shape == (2, len(PROMPT), 2) and int(routing.max()) < 8
        # the hook saw what the router computes from the same hidden states
        router = eng.runner.routers[0]
        seen = {}
        h = router.register_forward_hook(lambda m, a, o: seen.update(x=a[0].clone()))
        _, r2 = eng.runner.forward(eng.runner.new_cache(), list(PROMPT))
        h.remove()
        assert torch.equal(r2, routing)
        probs = torch.softmax(torch.nn.functional.linear(seen["x"].reshape(-1, seen["x"].shape[-1]), router.weight), -1)
        assert torch.equal(torch.topk(probs, 2, dim=-1).indices, routing[0])
        ev = eng.generate_sync(GenerationRequest("m", PROMPT, SP), timeout=60)
        assert len(ev) == 10
    finally:
        eng.close()


def test_make_tiny_writes_a_folder_transformers_and_dynamo_can_load(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for flag, arch in ((["--arch", "llama"], "LlamaForCausalLM"),
                       (["--moe", "--arch", "mixtral"], "MixtralForCausalLM")):
        out = tmp_path / arch
        assert make_tiny_main(["--out", str(out)] + flag) == 0
        assert json.loads((out / "config.json").read_text())["architectures"] == [arch]  # Dynamo needs it
        cfg = json.loads((out / "tokenizer_config.json").read_text())
        assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast" and "im_start" in cfg["chat_template"]
        tok = AutoTokenizer.from_pretrained(str(out))
        text = tok.apply_chat_template([{"role": "user", "content": "héllo"}], tokenize=False,
                                       add_generation_prompt=True)
        ids = tok(text)["input_ids"]
        assert ids[0] == special_ids()["<|im_start|>"] and tok.decode(ids) == text
        model = AutoModelForCausalLM.from_pretrained(str(out))
        assert type(model).__name__ == arch and max(ids) < model.config.vocab_size
        eng = ReferenceEngine.from_pretrained(out)
        try:
            assert len(eng.generate_sync(GenerationRequest("x", tuple(ids), SamplingParams(max_tokens=3)), 60)) == 3
        finally:
            eng.close()


def test_no_torchao_warnings_where_we_build_models(tmp_path):
    """torchao (a benchmark baseline and test reference, installed with the extras) logs 'Failed to load' for its
    CUDA libraries on a CPU-only torch, and triggers torch pytree deprecations, when transformers first loads it;
    make_tiny and the reference engine import it quietly first (syncd.lazy.quiet_optional_imports)."""
    import subprocess
    import sys

    code = ("import sys; from syncd.engine.reference.make_tiny import main; main(['--out', sys.argv[1]]); "
            "from syncd.engine.reference.engine import ReferenceEngine; ReferenceEngine.from_pretrained(sys.argv[1])")
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "m")], capture_output=True, text=True, timeout=300,
                       cwd=Path(__file__).resolve().parents[2])
    assert p.returncode == 0, p.stderr[-2000:]
    assert "Failed to load" not in p.stderr and "_pytree" not in p.stderr, p.stderr[-2000:]
