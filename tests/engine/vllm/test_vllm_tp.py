"""A real vLLM (CPU) on two tensor-parallel ranks (two worker processes, gloo) serving a tiny Qwen2 whose one KV
head both ranks replicate takes real published deltas in place while it serves. Each rank writes its own slices
(column-parallel q/k/v and gate/up rows, row-parallel o/down columns, vocabulary rows); the engine names them
``tp<rank>.<name>`` and its checksums cover both ranks bit for bit; vLLM's logprobs equal transformers' on the
trainer's weights after every apply (so every slice is where vLLM computes with it). An apply that fails on one
rank only is undone on the other: all or nothing across ranks. The trainer publishes delta format 2 for the KV
head both ranks hold whole (context-coded, decoded against each rank's own copy) and format 1 for the sliced tensors
(``sliced_tensors``); a format-2 delta of a sliced tensor is refused at stage, naming it. One engine for the module."""

from __future__ import annotations

import os

import pytest
import torch

from syncd.engines.params import expected_checksums
from syncd.engines.update import Update
from syncd.errors import DeltaError
from syncd.ops import delta
from tests.engine.vllm.conftest import engine_and_trainer, matches_transformers, update_while_streaming

pytestmark = [pytest.mark.integration, pytest.mark.slow]

#: what each rank holds only a slice of (the KV head and the norms both ranks hold whole)
SLICED = r".*\.(q_proj|o_proj|gate_proj|up_proj|down_proj)\.(weight|bias)|model\.embed_tokens\.weight|lm_head\.weight"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    # the failure test runs a function of its own in each worker (collective_rpc of a callable: pickled)
    prev = os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    try:
        yield from engine_and_trainer(tmp_path_factory, "qwen2", seed=5, tensor_parallel=2,
                                      publisher=dict(delta_format=2, sliced_tensors=SLICED))
    finally:
        if prev is None:
            os.environ.pop("VLLM_ALLOW_INSECURE_SERIALIZATION", None)
        else:
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = prev


def _bit_exact(eng, trainer, version) -> bool:
    return eng.version == version and eng.checksum() == expected_checksums(eng.parameters(), trainer.snaps[version])


def test_both_ranks_named_and_bit_exact_at_start(setup):
    eng, trainer = setup
    names = [s.name for s in eng.parameters()]
    assert {n.split(".", 1)[0] for n in names} == {"tp0", "tp1"}
    qkv = {s.name: s for s in eng.parameters()}["tp1.model.layers.0.self_attn.qkv_proj.weight"]
    q = next(p for p in qkv.pieces if p.source.endswith("q_proj.weight"))
    assert (q.start, q.stop) == (64, 128)  # rank 1's head of two (head_dim 64)
    assert _bit_exact(eng, trainer, 0)
    assert matches_transformers(eng, trainer, 0, [3 * j % 250 + 1 for j in range(40)]) < 1e-4
    one = eng.checksum(["tp1.model.norm.weight"])
    assert list(one) == ["tp1.model.norm.weight"]
    with pytest.raises(KeyError, match="tp<rank>"):
        eng.checksum(["model.norm.weight"])


def test_deltas_in_place_on_both_ranks_while_serving(setup):
    eng, trainer = setup

    def check(v, staged):
        assert [r["version"] for r in staged["ranks"]] == [v, v]
        assert staged["words"] == sum(r["words"] for r in staged["ranks"])
        assert _bit_exact(eng, trainer, v)
        assert len(eng.last_write["ranks"]) == 2 and eng.last_write["rebuilt"] == 0

    update_while_streaming(eng, trainer, streams=2, max_tokens=200, check=check)
    assert eng.version == 2
    context = {n for v in (1, 2) for n, b in trainer.update(v).tensors.items() if delta.needs_base(b)}
    assert context and all(n.endswith(("k_proj.weight", "v_proj.weight")) for n in context), context
    assert matches_transformers(eng, trainer, 2, [5 * j % 250 + 2 for j in range(40)]) < 1e-4


def _flip_rank1_word(worker):
    """Run in each worker (collective_rpc): on rank 1, flip a bit of the first staged position's word, so that
    rank's apply finds a word it did not stage. Returns what to pass to :func:`_restore`."""
    st = worker.weight_transfer_engine.state
    if st.rank != 1:
        return None
    p = st.updater.staged.params[0]
    pos = int(p.index[0])
    flat = st.updater.tensors()[p.name].reshape(-1).view(torch.int16)
    old = int(flat[pos])
    flat[pos] = old ^ 1
    return p.name, pos, old


def _restore(worker, undo):
    st = worker.weight_transfer_engine.state
    if st.rank == 1 and undo is not None:
        name, pos, old = undo
        st.updater.tensors()[name].reshape(-1).view(torch.int16)[pos] = old
    return st.updater.version


def test_an_apply_one_rank_refuses_is_undone_on_the_other(setup):
    eng, trainer = setup
    before = eng.version
    v = trainer.step()
    eng.stage(trainer.update(v))
    undo = eng.run(lambda llm: llm.collective_rpc(_flip_rank1_word))
    assert undo[0] is None and undo[1] is not None
    eng.pause()
    with pytest.raises(DeltaError):
        eng.apply()
    versions = eng.run(lambda llm: llm.collective_rpc(_restore, args=(undo[1],)))
    eng.resume()
    assert versions == [before, before] and eng.version == before  # rank 0 wrote its part and undid it
    assert _bit_exact(eng, trainer, before)
    eng.stage(trainer.update(v))  # the same update, staged again, now applies on both
    eng.pause()
    eng.apply()
    eng.resume()
    assert _bit_exact(eng, trainer, v)
    assert matches_transformers(eng, trainer, v, [7 * j % 250 + 3 for j in range(40)]) < 1e-4


def test_a_format2_delta_of_a_sliced_tensor_is_refused_at_stage(setup):
    eng, trainer = setup
    before = eng.version
    v = trainer.step()
    upd = trainer.update(v)
    q = "model.layers.0.self_attn.q_proj.weight"
    blobs = dict(upd.tensors, **{q: delta.encode(trainer.snaps[v - 1][q], trainer.snaps[v][q], version=2)})
    assert delta.needs_base(blobs[q])
    with pytest.raises(DeltaError, match=r"q_proj\.weight.*context blocks \(format 2\).*holds only \[\d+:\d+\)"):
        eng.stage(Update(v, "delta", blobs, base_version=before, checksums=upd.checksums))
    assert _bit_exact(eng, trainer, before)
    eng.stage(upd)  # the run's own update (q_proj in format 1) applies
    eng.pause()
    eng.apply()
    eng.resume()
    assert _bit_exact(eng, trainer, v)
