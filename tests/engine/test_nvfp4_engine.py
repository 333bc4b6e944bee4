"""The reference engine serves NVFP4 weights and takes NVFP4 versions as deltas of the packed codes and scales.

A tiny Qwen2 trains with QAT (``syncd.trainer.qat``) through real AdamW steps; ``WeightPublisher(..., dtype=None)``
publishes ``export_nvfp4(model)`` after every step to a file store. The engine starts from version 0
(``from_store``) and serves while a controller thread stages, pauses, applies and resumes each later version.
After each apply the engine's packed tensors are the trainer's quantization byte for byte, the weights it
computes with are their dequantization bit for bit, and its logits are the trainer's QAT model's; every
token of every request is what the trainer's QAT model, at the version the token carries, samples.
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

from syncd.engines.protocol import GenerationRequest, SamplingParams
from syncd.engines.update import Update
from syncd.engine.reference import ReferenceEngine
from syncd.engine.reference.make_tiny import write_model
from syncd.engine.reference.sampling import sample
from syncd.engines.update import Update
from syncd.ops import checksum, nvfp4
from syncd.store import Store
from syncd.versions import fetch_shards, read_manifest
from tests.engine._serving import check_served, serve_while_updating
from tests.store._models import bits, train_steps
from syncd.trainer import WeightPublisher
from syncd.trainer.qat import disable_qat, enable_qat, export_nvfp4

KEY = "nvfp4-engine-test-key-0123456789"
RUN = "nvfp4"
N_DELTAS = 4
LR = 3e-5  # moves ~1% of the codes per step, and some per-tensor scales: both refresh paths run
PROMPT = [7, 200, 31, 99, 12, 150]


def _config():
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                       tie_word_embeddings=False)


def _serving_copy(model):
    """The trainer's QAT model as the engine must compute it: a copy whose QAT-wrapped weights are the
    float32 master weights (the fake-quant casts them to bf16 and quantizes, as the export does) and whose
    other floating-point tensors are rounded to bf16 (what ``export_nvfp4`` ships), computing in float32."""
    ref = copy.deepcopy(model)
    disable_qat(ref)
    names = set(enable_qat(ref))
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if n not in names:
                p.copy_(p.to(torch.bfloat16))
    return ref.eval().requires_grad_(False)


class _Trainer:
    """Trains and publishes once per module: ``published[v]`` (the NVFP4 state dict of version v),
    ``models[v]`` (the trainer's QAT model at version v, serving precision), ``names`` (the QAT weights)."""

    def __init__(self, root):
        from transformers import Qwen2ForCausalLM

        self.store = Store(root)
        self.config = _config()
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(self.config)
        self.names = enable_qat(model)
        self.published, self.models = [], []
        with WeightPublisher(self.store, RUN, signing_key=KEY, full_every=100, dtype=None) as pub:
            def step(s, m):
                state = export_nvfp4(m)
                assert pub.publish(state, s)
                self.published.append({k: v.clone() for k, v in state.items()})
                self.models.append(_serving_copy(m))

            step(0, model)
            train_steps(model, N_DELTAS, lr=LR, callback=lambda s, m: step(s + 1, m))
        self.history = list(pub.history)

    def manifest(self, v):
        return read_manifest(self.store, RUN, v, signing_key=KEY)

    def update(self, v) -> Update:
        m = self.manifest(v)
        return Update.from_shards(m, fetch_shards(self.store, RUN, m))

    def engine(self, **kw) -> ReferenceEngine:
        return ReferenceEngine.from_store(self.store, RUN, 0, config=copy.deepcopy(self.config), signing_key=KEY,
                                          **kw)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return _Trainer(tmp_path_factory.mktemp("nvfp4-store"))


def _logits(model, cache, feed) -> torch.Tensor:
    """One forward of a transformers model exactly as ``HFRunner.forward`` runs it: float32 logits of the
    last position of ``feed``, run after what ``cache`` holds."""
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([feed]), use_cache=True, logits_to_keep=1, **{kw: cache})
    return out.logits[0, -1].float().cpu()


def _new_cache(config):
    from transformers import DynamicCache

    return DynamicCache(config=config)


def _assert_engine_holds(eng, trained, v):
    """The engine's packed tensors, checksums, computed-with weights and logits are version ``v``'s."""
    want = trained.published[v]
    local = eng.updater.tensors()
    assert list(local) == list(want)  # the trainer's names, in order: .qdata/.scales/.per_tensor_scale in place
    for name, t in want.items():
        assert local[name].dtype == t.dtype and torch.equal(bits(local[name]), bits(t)), (v, name)
    assert eng.checksum() == {t.name: t.checksum for t in trained.manifest(v).tensors}
    served = nvfp4.dequantize_state_dict(want, torch.bfloat16)
    for name in trained.names:  # what the engine computes with: dequantize(trainer's quantization), bit for bit
        got = eng.runner.model.get_parameter(name)
        assert got.dtype == torch.float32 and torch.equal(bits(got), bits(served[name].float())), (v, name)
    # pause() guarantees no forward runs, so this thread may use the runner; a fresh cache of its own
    got = eng.runner.forward(eng.runner.new_cache(), PROMPT)[0]
    assert torch.equal(got, _logits(trained.models[v], _new_cache(trained.config), PROMPT)), v


def _assert_engine_holds_while_paused(eng, trained, v):
    eng.pause()
    try:
        _assert_engine_holds(eng, trained, v)
    finally:
        eng.resume()


def test_engine_serves_qat_versions_applied_as_nvfp4_deltas(trained):
    assert [s.kind for s in trained.history] == ["full"] + ["delta"] * N_DELTAS
    eng = trained.engine(max_batch=3)
    assert eng.version == 0 and eng.runner.nvfp4.names == trained.names
    packed = eng.runner.nvfp4.packed_bytes
    assert packed == sum(t.nbytes for k, t in trained.published[0].items() if k.endswith(nvfp4.SUFFIXES))
    requests = [GenerationRequest(f"r{i}", PROMPT[:3] + [40 + i],
                                  SamplingParams(max_tokens=40, temperature=0.0 if i % 2 else 1.0, top_p=0.9,
                                                 seed=i))
                for i in range(5)]
    applied = {}

    def check(v):
        applied[v] = eng.updater.last_applied
        _assert_engine_holds(eng, trained, v)

    events, boundaries = serve_while_updating(eng, requests, N_DELTAS, lambda v: eng.stage(trained.update(v)), check,
                                              first=lambda: _assert_engine_holds_while_paused(eng, trained, 0))

    # the versions are deltas of the packed bytes: a small fraction of them
    for v in range(1, N_DELTAS + 1):
        m = trained.manifest(v)
        assert m.kind == "delta"
        blob_bytes = sum(t.length for t in m.tensors if t.name.endswith(nvfp4.SUFFIXES))
        assert 0 < blob_bytes < packed / 10, (v, blob_bytes, packed)
        changed = {p.name for p in applied[v].params}
        assert any(n.endswith(nvfp4.QDATA) for n in changed)  # codes moved in place
    # both refresh paths ran: whole weights (the per-tensor scale changed) and single blocks (it did not)
    whole = blockwise = 0
    for s in applied.values():
        written = {p.name for p in s.params}
        for name in trained.names:
            if name + nvfp4.PER_TENSOR_SCALE in written:
                whole += 1
            elif name + nvfp4.QDATA in written or name + nvfp4.SCALES in written:
                blockwise += 1
    assert whole and blockwise, (whole, blockwise)

    # no request lost or restarted; tokens after each apply carry the new version
    by_req = check_served(events, boundaries, requests, N_DELTAS)

    # every token (greedy and sampled) is what the trainer's QAT model at the token's version gives
    for r in requests:
        evs, cache, feed = by_req[r.request_id], _new_cache(trained.config), list(r.prompt_token_ids)
        for i, e in enumerate(evs):
            s = sample(_logits(trained.models[e.version], cache, feed), r.sampling, r.sampling.seed,
                       len(r.prompt_token_ids) + i)
            assert (s.token_id, s.logprob) == (e.token_id, e.logprob), (r.request_id, i, e.version)
            feed = [e.token_id]


def test_rollback_and_load_full_refresh_what_the_engine_computes_with(trained):
    with trained.engine() as eng:
        eng.stage(trained.update(1))
        eng.pause()
        eng.apply()
        _assert_engine_holds(eng, trained, 1)
        eng.rollback()
        assert eng.version == 0
        _assert_engine_holds(eng, trained, 0)
        assert eng.runner.nvfp4.stale() == []
        full = trained.published[3]
        eng.load_full(Update(3, "full", full, checksums={k: checksum(t) for k, t in full.items()}))
        _assert_engine_holds(eng, trained, 3)
        # a full version staged against the current weights moves only the differing bytes, like a delta
        eng.stage(Update(4, "full", trained.published[4]))
        eng.apply()
        _assert_engine_holds(eng, trained, 4)
        eng.resume()
        ev = eng.generate_sync(GenerationRequest("g", PROMPT, SamplingParams(max_tokens=4, temperature=0.0)), 60)
        assert [e.version for e in ev] == [4] * 4


def test_apply_is_all_or_nothing_when_the_refresh_fails(trained, monkeypatch):
    """Fault injection (the dequantization of valid packed tensors cannot fail by itself): the first refresh
    after an apply raises; the engine puts the packed bytes back and recomputes, and holds version 0."""
    with trained.engine() as eng:
        real = eng.runner.nvfp4.refresh
        calls = []

        def failing_once(changed):
            calls.append(changed)
            if len(calls) == 1:
                raise MemoryError("injected")
            return real(changed)

        monkeypatch.setattr(eng.runner.nvfp4, "refresh", failing_once)
        eng.stage(trained.update(1))
        eng.pause()
        with pytest.raises(MemoryError, match="injected"):
            eng.apply()
        assert eng.version == 0 and len(calls) == 2
        _assert_engine_holds(eng, trained, 0)
        assert eng.runner.nvfp4.stale() == []
        eng.stage(trained.update(1))  # and the update still goes through afterwards
        eng.apply()
        _assert_engine_holds(eng, trained, 1)
        eng.resume()


def test_nvfp4_weights_are_refused_where_they_cannot_be_served(trained):
    state = trained.published[0]
    with pytest.raises(ValueError, match="does not slice NVFP4"):
        ReferenceEngine.from_state_dict(state, copy.deepcopy(trained.config), tp_size=2)
    name = trained.names[0]
    broken = {k: t for k, t in state.items() if k != name + nvfp4.SCALES}
    with pytest.raises(ValueError, match="incomplete"):
        ReferenceEngine.from_state_dict(broken, copy.deepcopy(trained.config))
    cast = dict(state, **{name + nvfp4.PER_TENSOR_SCALE: state[name + nvfp4.PER_TENSOR_SCALE].to(torch.bfloat16)})
    with pytest.raises(ValueError, match="per_tensor_scale must be one float32"):
        ReferenceEngine.from_state_dict(cast, copy.deepcopy(trained.config))


def test_make_tiny_nvfp4_model_serves_from_pretrained(tmp_path):
    from safetensors.torch import load_file

    plain = write_model(tmp_path / "plain", arch="llama", seed=3)
    folder = write_model(tmp_path / "nvfp4", arch="llama", seed=3, nvfp4=True)
    stored = load_file(str(folder / "model.safetensors"))
    want = nvfp4.quantize_state_dict(load_file(str(plain / "model.safetensors")))
    assert sorted(stored) == sorted(want) and all(torch.equal(bits(stored[k]), bits(want[k])) for k in want)
    assert len(nvfp4.nvfp4_names(stored)) == 2 * 7
    with ReferenceEngine.from_pretrained(folder) as eng:
        names = [s.name for s in eng.parameters()]
        assert "model.layers.0.mlp.down_proj.weight.qdata" in names and "model.layers.0.mlp.down_proj.weight" \
            not in names
        ev = eng.generate_sync(GenerationRequest("a", [1, 2, 3], SamplingParams(max_tokens=5, temperature=0.0)), 60)
        assert len(ev) == 5 and all(0 <= e.token_id < 320 for e in ev)
    with pytest.raises(ValueError, match="dense"):
        write_model(tmp_path / "moe", arch="qwen3_moe", nvfp4=True)


@pytest.mark.gpu
def test_nvfp4_engine_on_cuda_takes_deltas_bit_for_bit(trained):
    eng = trained.engine(device="cuda")
    try:
        assert eng.runner.compute_dtype == torch.bfloat16
        for v in (1, 2):
            eng.stage(trained.update(v))
            eng.pause()
            eng.apply()
            eng.resume()
            assert eng.checksum() == {t.name: t.checksum for t in trained.manifest(v).tensors}
            local = eng.updater.tensors()
            assert all(torch.equal(bits(local[k].cpu()), bits(t)) for k, t in trained.published[v].items())
            served = nvfp4.dequantize_state_dict(trained.published[v], torch.bfloat16)  # the CPU backend
            for name in trained.names:
                assert torch.equal(bits(eng.runner.model.get_parameter(name).cpu()), bits(served[name])), name
        eng.pause()
        eng.rollback()
        eng.resume()
        assert eng.runner.nvfp4.stale() == [] and eng.checksum() == {
            t.name: t.checksum for t in trained.manifest(1).tensors}
        ev = eng.generate_sync(GenerationRequest("a", PROMPT, SamplingParams(max_tokens=4, temperature=0.0)), 120)
        assert {e.version for e in ev} == {1}
    finally:
        eng.close()
