"""NVFP4 state dicts: the published naming, the round trip an engine does, and the refusals."""

from __future__ import annotations

import pytest
import torch

from syncd.ops import nvfp4
from tests.ops._util import same_bits
from tests.store._models import tiny_qwen2


def test_linear_weights_become_three_parts_in_place():
    state = tiny_qwen2().state_dict()
    out = nvfp4.quantize_state_dict(state)
    names = nvfp4.nvfp4_names(out)
    assert names == [n for n, t in state.items() if nvfp4.is_linear_weight(n, t)]
    assert "model.layers.0.self_attn.q_proj.weight" in names and "lm_head.weight" not in names
    assert not any("embed" in n or "norm" in n for n in names)
    order = []
    for n in state:
        order += [n + s for s in nvfp4.SUFFIXES] if n in names else [n]
    assert list(out) == order
    w = state["model.layers.1.mlp.down_proj.weight"]
    base = "model.layers.1.mlp.down_proj.weight"
    n, k = w.shape
    assert out[base + ".qdata"].dtype == torch.uint8 and out[base + ".qdata"].shape == (n, k // 2)
    assert out[base + ".scales"].dtype == torch.float8_e4m3fn and out[base + ".scales"].shape == (n, k // 16)
    assert out[base + ".per_tensor_scale"].dtype == torch.float32 and out[base + ".per_tensor_scale"].shape == ()
    assert all(t.dtype == torch.bfloat16 for n, t in out.items() if not n.endswith(nvfp4.SUFFIXES))
    q = nvfp4.quantize(w.to(torch.bfloat16))  # the chosen weights are cast to the serving dtype first
    assert same_bits(out[base + ".qdata"], q.qdata) and same_bits(out[base + ".scales"], q.scales)


def test_engine_side_load_and_dequantize_round_trip():
    state = tiny_qwen2().state_dict()
    out = nvfp4.quantize_state_dict(state, names=lambda n, t: n.endswith("proj.weight"), dtype=None)
    loaded = nvfp4.load_state_dict(out)
    assert list(loaded) == list(state)
    w = "model.layers.0.mlp.gate_proj.weight"
    assert isinstance(loaded[w], nvfp4.NVFP4Tensor) and loaded[w].shape == state[w].shape
    deq = nvfp4.dequantize_state_dict(out, torch.float32)
    assert same_bits(deq[w], nvfp4.quantize(state[w]).dequantize(torch.float32))
    assert same_bits(deq["model.norm.weight"], state["model.norm.weight"])  # dtype=None kept float32


def test_explicit_names_and_refusals():
    state = {"a.weight": torch.randn(4, 32), "b.weight": torch.randn(4, 20), "b.bias": torch.randn(4)}
    with pytest.raises(KeyError):
        nvfp4.quantize_state_dict(state, names=["c.weight"])
    with pytest.raises(ValueError, match="b.weight.*multiple of 16"):
        nvfp4.quantize_state_dict(state, names=["b.weight"])
    clash = dict(state, **{"a.weight.scales": torch.zeros(1)})
    with pytest.raises(ValueError, match="already in the state dict"):
        nvfp4.quantize_state_dict(clash, names=["a.weight"])
    out = nvfp4.quantize_state_dict(state, names=["a.weight"])
    incomplete = {k: v for k, v in out.items() if not k.endswith(".scales")}
    with pytest.raises(ValueError, match="incomplete"):
        nvfp4.load_state_dict(incomplete)
    cast = dict(out, **{"a.weight.per_tensor_scale": out["a.weight.per_tensor_scale"].to(torch.bfloat16)})
    with pytest.raises(ValueError, match="float32"):  # what a publisher with dtype=bfloat16 would have shipped
        nvfp4.load_state_dict(cast)
    orphan = {k: v for k, v in out.items() if not k.endswith(".qdata")}
    with pytest.raises(ValueError, match="no .qdata"):
        nvfp4.load_state_dict(orphan)
