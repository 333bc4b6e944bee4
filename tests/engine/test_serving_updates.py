"""The reference engine serves while another thread stages and applies a sequence of real deltas, published by
``syncd.trainer.WeightPublisher`` from real AdamW steps into a local file store and read back with
``syncd.versions``. No request is dropped or restarted, tokens after each apply carry the new version,
``checksum()`` equals the trainer's after each apply, and every token's replay record lands in the store."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from syncd.engines.protocol import GenerationRequest, SamplingParams
from syncd.engine.reference import ReferenceEngine
from syncd.engine.replay import ReplayRecorder, read_request
from syncd.engines.params import expected_checksums
from syncd.engines.update import Update
from syncd.ops import checksum
from syncd.store import Store
from syncd.versions import fetch_shards, read_manifest
from tests.engine._serving import check_served, serve_while_updating
from tests.store._models import train_steps
from syncd.trainer import WeightPublisher

KEY = "engine-test-signing-key-0123456789"
RUN = "serve"
N_DELTAS = 4


def _publish(model_dir, store, run=RUN):
    """Version 0 (full) and N_DELTAS delta versions from real AdamW steps; returns the bf16 snapshots."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    snaps = []
    with WeightPublisher(store, run, signing_key=KEY, full_every=100) as pub:
        def step(s, m):
            assert pub.publish(m, s)
            snaps.append({k: v.detach().to(torch.bfloat16) for k, v in m.state_dict().items()})

        step(0, model)
        train_steps(model, N_DELTAS, lr=3e-4, callback=lambda s, m: step(s + 1, m))
    return snaps


@pytest.mark.parametrize("tp_size", [1, 2], ids=["tp1", "tp2-fused-sliced"])
def test_generation_continues_across_real_published_deltas(dense_dir, tmp_path, tp_size):
    store = Store(tmp_path / "store")
    snaps = _publish(dense_dir, store)
    recorder = ReplayRecorder(store, RUN, chunk_tokens=16)
    from transformers import AutoConfig

    eng = ReferenceEngine.from_store(store, RUN, 0, config=AutoConfig.from_pretrained(str(dense_dir)),
                                     signing_key=KEY, recorder=recorder, max_batch=3, tp_size=tp_size)
    requests = [GenerationRequest(f"r{i}", (257, 84, 82, 68, 81 + i),
                                  SamplingParams(max_tokens=60, temperature=1.0, top_p=0.95, seed=i))
                for i in range(5)]
    manifests = {}

    def stage(v):
        m = manifests[v] = read_manifest(store, RUN, v, signing_key=KEY)
        eng.stage(Update.from_shards(m, fetch_shards(store, RUN, m)))

    def check(v):
        got = eng.checksum()
        assert got == expected_checksums(eng.parameters(), {t.name: t.checksum for t in manifests[v].tensors}) \
            if tp_size == 1 else got == expected_checksums(eng.parameters(), snaps[v])

    try:
        events, boundaries = serve_while_updating(eng, requests, N_DELTAS, stage, check)
    finally:
        recorder.close()

    assert eng.version == N_DELTAS
    assert eng.checksum() == expected_checksums(eng.parameters(), snaps[-1])
    if tp_size == 1:
        assert eng.checksum() == {k: checksum(v) for k, v in snaps[-1].items()}
    by_req = check_served(events, boundaries, requests, N_DELTAS)

    # every token's replay record is in the store under runs/<run>/replay/<request>/
    for rid, evs in by_req.items():
        chunks = read_request(store, RUN, rid)
        recs = [r for c in chunks for r in c.records]
        assert [(r.index, r.version, r.token_id) for r in recs] == [(e.index, e.version, e.token_id) for e in evs]
        assert np.allclose([r.logprob for r in recs], [e.logprob for e in evs])
        assert all(r.token_id in r.kept for r in recs)
        assert recs[0].position == 5 and all(r.routing is None for r in recs)
    assert all(k.startswith(f"runs/{RUN}/replay/") for k in recorder.written)
