"""The thin trainer's loss and optimizers on a real tiny Qwen2: the policy-gradient gradient against a plain
autograd reference (full-vocabulary kept sets, engine log-probs that differ so the IS cap bites), micro-batching,
the step diagnostics, the Moonlight split and Muon's update RMS."""

from __future__ import annotations

import pytest
import torch

from syncd.engine.reference.make_tiny import model_config, random_model
from syncd.trainer.rl.objective import LossConfig, policy_gradient_loss, step_diagnostics
from syncd.trainer.optim import build_optimizer, muon_split
from syncd.trainer.rl.rollouts import NO_VERSION, RolloutSequence

V = 320


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return random_model(model_config("qwen2", hidden=32, layers=2, intermediate=64), seed=1)


def _sequence(gen: torch.Generator, prompt: int, out: int, version: int, noise: float) -> RolloutSequence:
    T = prompt + out
    tokens = torch.randint(0, V, (T,), generator=gen)
    positions = torch.arange(prompt, T)
    mask = torch.zeros(T, dtype=torch.bool)
    mask[positions] = True
    versions = torch.full((T,), NO_VERSION)
    versions[positions] = version
    logprobs = torch.zeros(T)
    logprobs[positions] = -torch.log(torch.tensor(float(V))) + noise * torch.randn(out, generator=gen)
    kept = torch.arange(V, dtype=torch.int32).repeat(out)
    offsets = torch.arange(out + 1, dtype=torch.int64) * V
    return RolloutSequence(tokens, mask, versions, logprobs, positions, kept, offsets,
                           torch.full((T,), version), None, V, 0, [0], ["r"], 1.0)


def _reference_grads(model, seqs, adv, normalizer, cap):
    model.zero_grad(set_to_none=True)
    total = 0.0
    for s, a in zip(seqs, adv):
        logits = model(input_ids=s.tokens[None]).logits[0].float()
        lp = torch.log_softmax(logits[s.positions - 1], -1).gather(1, s.tokens[s.positions][:, None])[:, 0]
        w = torch.exp(lp.detach() - s.logprobs[s.positions].double()).clamp(max=cap).float()
        loss = -(w * a * lp).sum() / normalizer
        loss.backward()
        total += float(loss.detach())
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_policy_gradient_matches_the_autograd_reference_and_micro_batches_agree(model):
    gen = torch.Generator().manual_seed(3)
    seqs = [_sequence(gen, 3 + i % 2, 5, version=i % 3, noise=1.0) for i in range(6)]
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, 0.0])
    N = sum(int(s.loss_mask.sum()) for s in seqs) + 7  # any global count (other ranks' tokens too)
    ref_loss, ref = _reference_grads(model, seqs, adv, N, cap=2.0)
    out = {}
    for mb in (64, 2):
        model.zero_grad(set_to_none=True)
        loss, rec = policy_gradient_loss(model, seqs, adv, normalizer=N, config=LossConfig(is_cap=2.0, micro_batch=mb))
        out[mb] = {n: p.grad.clone() for n, p in model.named_parameters()}
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-7)
        for n, g in ref.items():
            assert torch.allclose(out[mb][n], g, rtol=1e-4, atol=1e-7), n
    assert rec.trainer_logprobs.shape == (30,) and rec.seq.max() == 5  # sequence indices stay distinct
    assert bool((rec.weights <= 2.0).all()) and bool((rec.weights < torch.exp(
        rec.trainer_logprobs.double() - rec.engine_logprobs.double()).float() - 1e-6).any())  # the cap bit
    with pytest.raises(ValueError, match="6 sequences but 5 advantages"):
        policy_gradient_loss(model, seqs, adv[:5], normalizer=N)


def test_step_diagnostics_report_raw_ratios_and_staleness(model):
    gen = torch.Generator().manual_seed(4)
    seqs = [_sequence(gen, 3, 4, version=v, noise=0.0) for v in (2, 3, 3)]
    model.zero_grad(set_to_none=True)
    _, rec = policy_gradient_loss(model, seqs, torch.tensor([1.0, 0.0, -1.0]), normalizer=12)
    d = step_diagnostics(rec, current_version=3)
    assert d["staleness_counts"] == {"0": 8, "1": 4} and d["staleness_max"] == 1
    assert d["staleness_mean"] == pytest.approx(4 / 12)
    # engine log-probs of a uniform distribution: the ratio is what the model's own distribution gives
    lr = rec.trainer_logprobs.double() - rec.engine_logprobs.double()
    assert d["is_mean"] == pytest.approx(float(torch.exp(lr).mean()), rel=1e-9)
    assert d["kl_k3"] >= 0 and 0 <= d["is_outside"] <= 1
    with pytest.raises(ValueError, match="newer than the trainer"):
        step_diagnostics(rec, current_version=2)


def test_loss_config_is_checked():
    with pytest.raises(ValueError, match="IS cap"):
        LossConfig(is_cap=0.0)
    with pytest.raises(ValueError, match="is_band"):
        LossConfig(is_band=(1.2, 2.0))


def test_moonlight_split_puts_embeddings_head_norms_and_biases_in_adamw(model):
    muon, adamw = muon_split(model)
    assert "model.embed_tokens.weight" in adamw and "lm_head.weight" in adamw
    assert all(p.endswith(".weight") and "norm" not in p for p in muon)
    assert any("q_proj.weight" in p for p in muon) and any("down_proj.weight" in p for p in muon)
    assert any("q_proj.bias" in p for p in adamw) and any("layernorm" in p for p in adamw)
    assert sorted(muon + adamw) == sorted(n for n, _ in model.named_parameters())
    opt = build_optimizer(model, "muon", lr=1e-3)
    assert type(opt.optimizers[0]).__name__ == "Muon" and opt.groups["muon"] == muon


def test_muon_update_rms_matches_adamw_scale_whatever_the_shape():
    """match_rms_adamw: an update of RMS ~0.2 * lr for every matrix shape (the shape-dependent 'original'
    scaling would not give one band)."""
    torch.manual_seed(0)
    lin = torch.nn.ModuleDict({"a": torch.nn.Linear(64, 64, bias=False), "b": torch.nn.Linear(64, 256, bias=False),
                               "c": torch.nn.Linear(256, 64, bias=False)})
    lr = 1e-3
    opt = build_optimizer(lin, "muon", lr=lr)
    before = {n: p.detach().clone() for n, p in lin.named_parameters()}
    for p in lin.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    rms = {n: float((p.detach() - before[n]).pow(2).mean().sqrt()) / lr for n, p in lin.named_parameters()}
    assert all(0.15 < r < 0.25 for r in rms.values()), rms


def test_optimizer_errors_name_the_choice(model):
    with pytest.raises(ValueError, match="unknown optimizer 'sgd'; choose one of adamw, muon"):
        build_optimizer(model, "sgd")
    with pytest.raises(ValueError, match="lr > 0"):
        build_optimizer(model, "adamw", lr=0)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_the_loss_and_a_step_on_cuda_match_the_cpu_and_repeat_bit_for_bit(model, name):
    """On CUDA under deterministic mode: the gradient matches the CPU's within float tolerance, and two steps from
    the same weights end bit-identical (run by bench/gpu_check.sh)."""
    import copy

    from syncd.trainer.dist import make_deterministic, weights_digest

    make_deterministic(0)
    gen = torch.Generator().manual_seed(5)
    seqs = [_sequence(gen, 3, 6, version=0, noise=0.5) for _ in range(4)]
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    cpu = copy.deepcopy(model)
    cpu.zero_grad(set_to_none=True)
    policy_gradient_loss(cpu, seqs, adv, normalizer=24)
    digests = []
    for _ in range(2):
        gpu = copy.deepcopy(model).cuda()
        opt = build_optimizer(gpu, name, lr=1e-2)
        policy_gradient_loss(gpu, seqs, adv, normalizer=24)
        for (n, p), q in zip(gpu.named_parameters(), cpu.parameters()):
            assert torch.allclose(p.grad.cpu(), q.grad, rtol=1e-3, atol=1e-6), n
        opt.step()
        digests.append(weights_digest(gpu))
    assert digests[0] == digests[1]
