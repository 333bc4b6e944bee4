"""NVFP4 QAT (syncd.trainer.qat) with a real tiny Qwen2 and real AdamW steps: the forward uses exactly the weights
an engine serves from the published NVFP4 tensors, and the publisher + materialize ship them bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch

import syncd
from syncd.ops import nvfp4
from tests.ops._util import same_bits
from tests.store._models import assert_same, tiny_qwen2, train_steps
from syncd.trainer import WeightPublisher
from syncd.trainer.qat import disable_qat, enable_qat, export_nvfp4, fake_quant, qat_weight_names

KEY = "qat-test-key-0123456789abcdef"
PROJ = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj"]


def test_fake_quant_is_dequantize_of_quantize_with_straight_through_gradient():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(48, 64, generator=g) * 0.05).requires_grad_()
    fq = fake_quant(w)
    assert fq.dtype == torch.float32
    want = nvfp4.dequantize(nvfp4.quantize(w.detach().to(torch.bfloat16)), torch.bfloat16)
    assert same_bits(fq.detach().to(torch.bfloat16), want) and torch.equal(fq.detach(), want.float())
    x = torch.randn(5, 64, generator=g)
    upstream = torch.randn(5, 48, generator=g)
    (x @ fq.t() * upstream).sum().backward()
    leaf = fq.detach().clone().requires_grad_()
    (x @ leaf.t() * upstream).sum().backward()
    assert torch.equal(w.grad, leaf.grad)  # identity through the quantizer


def test_enable_qat_wraps_linear_weights_and_keeps_the_state_dict():
    model = tiny_qwen2()
    keys = list(model.state_dict())
    x = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = model(input_ids=x).logits
    names = enable_qat(model)
    assert names == [f"model.layers.{i}.{p}.weight" for i in range(2) for p in PROJ]
    assert qat_weight_names(model) == names and enable_qat(model) == names  # idempotent
    assert list(model.state_dict()) == keys
    with torch.no_grad():
        quantized = model(input_ids=x).logits
    assert not torch.equal(quantized, plain)
    disable_qat(model)
    assert qat_weight_names(model) == []
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, plain)


def test_the_engine_serves_exactly_what_the_qat_forward_computed():
    trainer_model = tiny_qwen2().to(torch.bfloat16)
    enable_qat(trainer_model)
    train_steps(trainer_model, 2, lr=1e-3)
    published = export_nvfp4(trainer_model)
    # the engine: a fresh model of the same architecture, loading the dequantized NVFP4 weights
    engine_model = tiny_qwen2(seed=5).to(torch.bfloat16)
    engine_model.load_state_dict(nvfp4.dequantize_state_dict(published, torch.bfloat16))
    x = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(trainer_model(input_ids=x).logits, engine_model(input_ids=x).logits)
    for name in qat_weight_names(trainer_model):
        w = trainer_model.get_parameter(name)
        assert same_bits(engine_model.get_parameter(name).detach(), fake_quant(w).detach())


def test_publisher_ships_nvfp4_versions_of_real_steps_bit_for_bit(tmp_path):
    model = tiny_qwen2()  # float32 master weights
    names = enable_qat(model)
    published, fq = [], []
    with WeightPublisher(tmp_path, "r", signing_key=KEY, full_every=3, dtype=None) as pub:
        def step(s, m):
            state = export_nvfp4(m)
            assert pub.publish(state, s)
            published.append({k: v.clone() for k, v in state.items()})
            fq.append({n: fake_quant(m.get_parameter(n)).detach().to(torch.bfloat16) for n in names})

        step(0, model)
        train_steps(model, 5, callback=lambda s, m: step(s + 1, m))
    stats = list(pub.history)
    assert [s.kind for s in stats] == ["full", "delta", "delta", "full", "delta", "delta"]
    assert all(s.uploaded_bytes < stats[0].full_bytes / 3 for s in stats if s.kind == "delta")
    changed = 0
    for v, want in enumerate(published):
        got = syncd.materialize(tmp_path, "r", v, signing_key=KEY)
        assert_same(got, want)
        served = nvfp4.dequantize_state_dict(got, torch.bfloat16)  # what the engine serves
        for n in names:
            assert same_bits(served[n], fq[v][n]), (v, n)
        if v:
            prev = published[v - 1]
            changed += sum(int((want[n + ".qdata"] != prev[n + ".qdata"]).sum()) for n in names)
    assert changed > 0  # the steps did move some NVFP4 codes: the deltas were not empty


def test_export_without_qat_quantizes_linear_weights_and_ignores_a_copy():
    model = tiny_qwen2()
    state = export_nvfp4(model)
    assert nvfp4.nvfp4_names(state) == [f"model.layers.{i}.{p}.weight" for i in range(2) for p in PROJ]
    other = copy.deepcopy(model)
    enable_qat(other, exclude=lambda n: "mlp" in n or "lm_head" in n)
    assert nvfp4.nvfp4_names(export_nvfp4(other)) == [f"model.layers.{i}.{p}.weight" for i in range(2)
                                                      for p in PROJ[:4]]


@pytest.mark.gpu
def test_qat_and_export_on_cuda_weights_match_the_cpu_bit_for_bit(tmp_path):
    model = tiny_qwen2().cuda()
    names = enable_qat(model)
    train_steps(model, 2)
    cpu_model = copy.deepcopy(model).cpu()
    for n in names:
        on_gpu = fake_quant(model.get_parameter(n)).detach().cpu()
        assert same_bits(on_gpu, fake_quant(cpu_model.get_parameter(n)).detach())
    state = export_nvfp4(model)
    assert all(t.is_cuda for t in state.values())
    assert_same({k: v.cpu() for k, v in state.items()}, export_nvfp4(cpu_model))
    with WeightPublisher(tmp_path, "r", signing_key=KEY, dtype=None) as pub:
        pub.publish(state, 0)
        train_steps(model, 1)
        later = export_nvfp4(model)
        pub.publish(later, 1)  # a delta, encoded on the GPU
    assert [s.kind for s in pub.history] == ["full", "delta"]
    assert_same(syncd.materialize(tmp_path, "r", 1, signing_key=KEY), {k: v.cpu() for k, v in later.items()})
