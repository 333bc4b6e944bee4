"""A real vLLM (CPU) serving a tiny Qwen3-MoE (8 experts, top-2, head_dim 64) takes real published deltas in
place while it serves: the trainer's fused expert tensors (``mlp.experts.gate_up_proj``/``down_proj``) land in
vLLM's stacked ``w13``/``w2`` expert weights, whose CPU-packed copies are rebuilt for the touched experts. After
every apply the worker's checksums equal the trainer's bit for bit, the packed copies equal vLLM's own packing,
and vLLM's logprobs equal transformers' on the trainer's weights. One engine for the module, its attention and
router computing with ``F.linear`` over the written weights (``cpu_gemm="torch"``)."""

from __future__ import annotations


import pytest

from syncd.engines.params import expected_checksums
from syncd.ops import delta
from tests.engine.vllm.conftest import engine_and_trainer
from tests.engine.vllm.conftest import matches_transformers as _matches_transformers
from tests.engine.vllm.conftest import update_while_streaming

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    # F.linear over the written weights for attention and the router (the dense module runs vLLM's oneDNN
    # copies); the experts are vLLM's packed copies either way
    yield from engine_and_trainer(tmp_path_factory, "qwen3_moe", seed=4, cpu_gemm="torch",
                                  publisher=dict(delta_format=2))


def test_moe_deltas_in_place_while_serving(setup):
    eng, trainer = setup
    names = {s.name: s for s in eng.parameters()}
    w13 = names["model.layers.0.mlp.experts.routed_experts.w13_weight"]
    assert w13.pieces[0].source == "model.layers.0.mlp.experts.gate_up_proj" and w13.shape == (8, 256, 128)
    assert eng.checksum() == expected_checksums(eng.parameters(), trainer.snaps[0])
    assert _matches_transformers(eng, trainer, 0, [3 * j % 250 + 1 for j in range(40)]) < 1e-4

    def check(v, staged):
        assert eng.checksum() == expected_checksums(eng.parameters(), trainer.snaps[v]), v
        assert eng.run(lambda llm: llm.collective_rpc("syncd_moe_consistent")) == [True]

    update_while_streaming(eng, trainer, streams=3, max_tokens=300, check=check)
    v = eng.version
    assert v == 2
    # delta format 2: the experts' (fused into w13) and the attention's deltas are context-coded, decoded against
    # the engine's own weights (one rank holds every tensor whole)
    context = {n for n, b in trainer.update(v).tensors.items() if delta.needs_base(b)}
    assert "model.layers.0.mlp.experts.gate_up_proj" in context and len(context) >= 4, context
    assert _matches_transformers(eng, trainer, v, [5 * j % 250 + 2 for j in range(40)]) < 1e-4
    w = eng.last_write  # F.linear layers have no packed copy to swap; the touched packed experts are repacked
    assert w["derive_s"] >= 0 and w["words"] > 0 and w["swapped"] == 0 and w["rebuilt"] > 0

    eng.pause()
    eng.rollback()
    eng.resume()
    assert eng.version == v - 1 and eng.checksum() == expected_checksums(eng.parameters(), trainer.snaps[v - 1])
    assert _matches_transformers(eng, trainer, v - 1, [7 * j % 250 + 3 for j in range(40)]) < 1e-4
