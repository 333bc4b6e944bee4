"""syncd.engine.vllm.layout: vLLM's parameter layout in the trainer's names, checked against the shapes transformers
gives the same configs and, for dense models, against syncd.engine.sharding's tensor-parallel layout (vLLM's). Pure:
no vLLM needed."""

from __future__ import annotations

import pytest
import torch

from syncd.engine.reference.make_tiny import model_config, random_model
from syncd.engine.sharding import tp_specs
from syncd.engine.vllm.layout import ModelShape, trainer_name, vllm_specs
from syncd.engines.params import build_local

SIZES = dict(hidden=128, heads=2, kv_heads=1, intermediate=256)


def _hf(arch):
    cfg = model_config(arch, **SIZES)
    return cfg, {k: v.detach().to(torch.bfloat16) for k, v in random_model(cfg, 0).state_dict().items()}


def _vllm_params(hf, shape: ModelShape, rank=0, world=1):
    """The (name, local shape) list vLLM's Qwen2/Qwen3-MoE model has (written out here, as the worker reports it)."""
    out = []
    for name, t in hf.items():
        if any(f".{w}_proj." in name for w in "kv") or ".up_proj." in name:
            continue
        if ".q_proj." in name:
            d, kind = shape.head_dim, name.rsplit(".", 1)[1]
            rows = shape.num_heads // world * d + 2 * max(1, shape.num_kv_heads // world) * d
            out.append((name.replace("q_proj", "qkv_proj"), (rows,) + tuple(t.shape[1:])))
        elif ".gate_proj." in name:
            out.append((name.replace("gate_proj", "gate_up_proj"), (2 * t.shape[0] // world, t.shape[1])))
        elif name.endswith("experts.gate_up_proj"):
            E, N, K = t.shape
            out.append((name.replace("experts.gate_up_proj", "experts.routed_experts.w13_weight"), (E, N // world, K)))
        elif name.endswith("experts.down_proj"):
            E, H, I_ = t.shape
            out.append((name.replace("experts.down_proj", "experts.routed_experts.w2_weight"), (E, H, I_ // world)))
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            out.append((name, (t.shape[0], t.shape[1] // world)))
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            out.append((name, (t.shape[0] // world, t.shape[1])))
        else:
            out.append((name, tuple(t.shape)))
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_dense_layout_is_the_tensor_parallel_layout(world):
    cfg, hf = _hf("qwen2")
    shape = ModelShape.from_config(cfg)
    for rank in range(world):
        got = vllm_specs(_vllm_params(hf, shape, rank, world), shape, rank=rank, world_size=world)
        if shape.num_kv_heads >= world:
            want = tp_specs(hf, rank=rank, world_size=world, num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads)
            mine = {s.name: s for s in got}
            assert sorted(mine) == sorted(s.name for s in want)
            for s in want:  # the same local tensors (ours map unsliced tensors 1:1, so base checksums are checked)
                assert torch.equal(build_local(mine[s.name], hf), build_local(s, hf)), s.name
        by = {s.name: s for s in got}
        qkv = build_local(by["model.layers.0.self_attn.qkv_proj.weight"], hf)
        q, k, v = (hf[f"model.layers.0.self_attn.{w}_proj.weight"] for w in "qkv")
        nq = q.shape[0] // world
        kv_rows = k.shape[0] if shape.num_kv_heads < world else k.shape[0] // world
        kv0 = 0 if shape.num_kv_heads < world else rank * kv_rows
        assert torch.equal(qkv, torch.cat([q[rank * nq:(rank + 1) * nq], k[kv0:kv0 + kv_rows], v[kv0:kv0 + kv_rows]]))


@pytest.mark.parametrize("world", [1, 2])
def test_moe_experts_map_onto_w13_and_w2(world):
    cfg, hf = _hf("qwen3_moe")
    shape = ModelShape.from_config(cfg)
    assert shape.head_dim == 64 and shape.moe_intermediate == 128
    pre = "model.layers.1.mlp.experts"
    for rank in range(world):
        by = {s.name: s for s in vllm_specs(_vllm_params(hf, shape, rank, world), shape, rank=rank,
                                              world_size=world)}
        w13, w2 = by[f"{pre}.routed_experts.w13_weight"], by[f"{pre}.routed_experts.w2_weight"]
        assert trainer_name(w13.name) == f"{pre}.gate_up_proj" and trainer_name(w2.name) == f"{pre}.down_proj"
        gu, down = hf[f"{pre}.gate_up_proj"], hf[f"{pre}.down_proj"]
        I_, n = gu.shape[1] // 2, gu.shape[1] // 2 // world
        want13 = torch.cat([gu[:, rank * n:(rank + 1) * n], gu[:, I_ + rank * n:I_ + (rank + 1) * n]], dim=1)
        assert torch.equal(build_local(w13, hf), want13)
        assert torch.equal(build_local(w2, hf), down[:, :, rank * n:(rank + 1) * n])
        assert by[f"{pre[:-len('.experts')]}.gate.weight"].pieces[0].source == f"{pre[:-len('.experts')]}.gate.weight"
        if world == 1:
            assert w13.pieces[0].dim is None and w2.pieces[0].dim is None  # 1:1: base checksums are checked


@pytest.mark.parametrize("world", [2, 3])
def test_expert_parallel_ranks_hold_whole_experts(world):
    """Expert parallelism: each rank holds whole experts, vLLM's linear placement (8 over 3 ranks: 3, 3, 2)."""
    from syncd.engine.vllm.layout import expert_slice

    cfg, hf = _hf("qwen3_moe")
    shape = ModelShape.from_config(cfg)
    assert shape.num_experts == 8
    pre = "model.layers.0.mlp.experts"
    gu, down = hf[f"{pre}.gate_up_proj"], hf[f"{pre}.down_proj"]
    seen = []
    for rank in range(world):
        first, count = expert_slice(8, rank, world)
        seen += list(range(first, first + count))
        params = [(f"{pre}.routed_experts.w13_weight", (count,) + tuple(gu.shape[1:])),
                  (f"{pre}.routed_experts.w2_weight", (count,) + tuple(down.shape[1:]))]
        by = {s.name: s for s in vllm_specs(params, shape, rank=rank, world_size=world, expert_parallel=True)}
        assert torch.equal(build_local(by[f"{pre}.routed_experts.w13_weight"], hf), gu[first:first + count])
        assert torch.equal(build_local(by[f"{pre}.routed_experts.w2_weight"], hf), down[first:first + count])
    assert seen == list(range(8)) and [expert_slice(8, r, 3)[1] for r in range(3)] == [3, 3, 2]


def test_a_padded_parameter_is_refused_by_name():
    cfg, hf = _hf("qwen2")
    shape = ModelShape.from_config(cfg)
    params = [(n, (s[0] + 64,) + s[1:]) if n == "lm_head.weight" else (n, s) for n, s in _vllm_params(hf, shape)]
    with pytest.raises(ValueError, match="lm_head.weight"):
        vllm_specs(params, shape)
