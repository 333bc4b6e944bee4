"""The CUDA paths of the update machinery and the reference engine (skipped without a GPU; run by
``bench/gpu_check.sh`` on the GPU machine): staging into pinned CPU memory, apply/rollback by on-device
scatter, TP ranks on the GPU, and generation in the weights' dtype."""

from __future__ import annotations

import pytest
import torch

from syncd.engine import StateDictEngine
from syncd.engines.protocol import GenerationRequest, SamplingParams
from syncd.engines.update import Update
from syncd.engine.sharding import tp_specs
from syncd.engines.params import expected_checksums
from syncd.ops import checksum, delta
from tests.store._models import bits, trajectory

pytestmark = pytest.mark.gpu


def _upd(states, v):
    return Update(v, "delta", {k: delta.encode(states[v - 1][k], states[v][k]) for k in states[0]},
                  base_version=v - 1)


def test_updates_on_cuda_tensors_are_bit_exact_and_roll_back():
    states = trajectory(4)
    for specs in (None, tp_specs(states[0], rank=1, world_size=2, num_heads=4, num_kv_heads=2)):
        if specs is None:
            eng = StateDictEngine({k: v.cuda() for k, v in states[0].items()}, 0)
        else:
            local = StateDictEngine.from_full(states[0], specs, 0).state_dict()
            specs = [s.__class__(s.name, s.dtype, s.shape, "cuda", s.pieces) for s in specs]
            eng = StateDictEngine({k: v.cuda() for k, v in local.items()}, 0, specs=specs)
        for v in (1, 2, 3):
            eng.stage(_upd(states, v))
            staged = eng.updater.staged
            assert all(p.index.device.type == "cpu" and p.index.is_pinned() for p in staged.params)
            eng.pause()
            eng.apply()
            eng.resume()
            assert eng.checksum() == expected_checksums(eng.parameters(), {k: t for k, t in states[v].items()})
        eng.pause()
        eng.rollback()
        assert eng.checksum() == expected_checksums(eng.parameters(), dict(states[2]))


def test_reference_engine_generates_on_the_gpu_and_takes_deltas(dense_dir):
    from syncd.engine.reference import ReferenceEngine
    from syncd.engine.reference.model import load_folder_weights

    w = load_folder_weights(dense_dir)
    eng = ReferenceEngine.from_pretrained(dense_dir, device="cuda")
    try:
        assert eng.runner.compute_dtype == torch.bfloat16
        sp = SamplingParams(max_tokens=8, temperature=0.7, seed=3)
        a = eng.generate_sync(GenerationRequest("a", (1, 2, 3), sp), timeout=120)
        b = eng.generate_sync(GenerationRequest("b", (1, 2, 3), sp), timeout=120)
        assert [e.token_id for e in a] == [e.token_id for e in b]
        new = {k: (v.view(torch.int16) + (v.dim() == 2)).view(torch.bfloat16) for k, v in w.items()}
        eng.stage(Update(1, "delta", {k: delta.encode(w[k], new[k]) for k in w}, base_version=0))
        eng.pause()
        eng.apply()
        eng.resume()
        assert eng.checksum() == {k: checksum(v) for k, v in new.items()}
        assert all(torch.equal(bits(eng.runner.local_tensors[k].cpu()), bits(new[k])) for k in new)
        assert {e.version for e in eng.generate_sync(GenerationRequest("c", (1, 2, 3), sp), 120)} == {1}
    finally:
        eng.close()
