"""syncd.engine.ReplayRecorder: MoE routing and kept sets recorded by the engine land in the store and read back (listed,
or, with a tolerance, to be rebuilt from the same logits); a failing store loses nothing; a migrated request's
records from two engines read back as one sequence."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from syncd.engines.protocol import GenerationRequest, SamplingParams
from syncd.engine.reference import ReferenceEngine
from syncd.engine.reference.sampling import kept_set
from syncd.engine.replay import ReplayRecorder, ReplayUploadError, list_requests, read_request, request_key
from syncd.ops.replay import rebuild_kept
from syncd.records.replay import KeptToRebuild
from syncd.store import Store
from tests.engine._refusing_store import RefusingStore

PROMPT = (257, 84, 82, 68, 81, 198, 71)


@pytest.mark.parametrize("tolerance", [None, 1e-3], ids=["listed", "to-rebuild"])
def test_moe_engine_records_routing_kept_sets_and_logprobs(moe_dir, tmp_path, tolerance):
    store = Store(tmp_path)
    rec = ReplayRecorder(store, "moe-run", chunk_tokens=4, kept_tolerance=tolerance)
    sp = SamplingParams(max_tokens=9, temperature=0.8, top_p=0.7, seed=5)
    with ReferenceEngine.from_pretrained(moe_dir, version=3, recorder=rec) as eng:
        events = eng.generate_sync(GenerationRequest("req/α 1", PROMPT, sp), timeout=60)
        # what the engine saw, recomputed step by step with the same runner
        cache = eng.runner.new_cache()
        logits, routing = eng.runner.forward(cache, list(PROMPT))
        steps = [(logits, routing)]
        for e in events[:-1]:
            steps.append(eng.runner.forward(cache, [e.token_id]))
    rec.close()
    chunks = read_request(store, "moe-run", "req/α 1")
    assert [len(c.records) for c in chunks] == [4, 4, 1]
    assert list_requests(store, "moe-run") == [request_key("req/α 1")] and request_key("req/α 1").startswith("h-")
    recs = [r for c in chunks for r in c.records]
    assert [r.token_id for r in recs] == [e.token_id for e in events]
    assert all(r.version == 3 for r in recs)
    assert [r.position for r in recs] == list(range(len(PROMPT), len(PROMPT) + 9))
    rebuilt = 0
    for r, e, (lg, rt) in zip(recs, events, steps):
        ids, _ = kept_set(lg, sp)
        if isinstance(r.kept, KeptToRebuild):  # rebuilt from the logits the engine sampled from
            rb = rebuild_kept(lg[None], [r.kept.top], torch.from_numpy(r.kept.extra), [0, r.kept.extra.size],
                              [r.kept.fingerprint], sp.temperature)
            assert r.kept.tolerance == np.float32(tolerance) and rb.status.tolist() == [0]
            r.kept, rebuilt = rb.ids.numpy(), rebuilt + 1
        assert np.array_equal(r.kept, np.sort(ids.numpy())) and r.token_id in r.kept
        assert np.array_equal(r.routing, rt[:, -1].numpy())  # experts at the position that sampled it
        assert r.logprob == pytest.approx(e.logprob, abs=1e-6) and r.logprob <= 0
    assert (rebuilt > 4) if tolerance else rebuilt == 0
    assert chunks[0].num_experts == 8
    assert chunks[0].prompt_routing_start == 0
    assert np.array_equal(chunks[0].prompt_routing, steps[0][1][:, :-1].transpose(0, 1).numpy())
    assert all(c.prompt_routing is None for c in chunks[1:])


def _add(rec, rid, start, n, version=1, index0=0):
    for i in range(n):
        rec.add(rid, position=start + i, index=index0 + i, version=version, token_id=i, logprob=-0.5,
                kept=torch.tensor([i, 99]))


def test_a_failing_store_loses_nothing(tmp_path):
    store = RefusingStore(tmp_path)
    rec = ReplayRecorder(store, "r", vocab_size=100, chunk_tokens=3)
    _add(rec, "a", 10, 7)
    rec.finish("a")
    with pytest.raises(ReplayUploadError, match="3 replay chunk"):
        rec.flush(timeout=30)
    assert read_request(store, "r", "a") == []
    store.refuse = False
    rec.close(timeout=30)
    recs = [r for c in read_request(store, "r", "a") for r in c.records]
    assert [r.position for r in recs] == list(range(10, 17))
    assert len(rec.written) == 3


def test_a_migrated_request_reads_back_in_order_across_writers(tmp_path):
    store = Store(tmp_path)
    first, second = ReplayRecorder(store, "r", vocab_size=100), ReplayRecorder(store, "r", vocab_size=100)
    _add(first, "mig", 5, 4, version=1)
    first.close()
    _add(second, "mig", 9, 3, version=2)  # continues at position 9 on another engine, its own index 0..2
    second.close()
    chunks = read_request(store, "r", "mig")
    assert [(c.first_position, len(c.records)) for c in chunks] == [(5, 4), (9, 3)]
    assert first.writer != second.writer and all("/replay/mig/" in k for k in first.written + second.written)


def test_recorder_refuses_bad_configuration(tmp_path):
    with pytest.raises(ValueError, match="run id"):
        ReplayRecorder(tmp_path, "../escape")
    for bad in (0, -1e-3, float("nan"), 1e4, "1e-3"):
        with pytest.raises(ValueError, match="kept_tolerance"):
            ReplayRecorder(tmp_path, "r", kept_tolerance=bad)
    rec = ReplayRecorder(tmp_path, "r")
    with pytest.raises(RuntimeError, match="vocab_size"):
        _add(rec, "x", 0, 1)
    rec.close()


def test_one_request_reads_bounded_bytes_and_a_foreign_chunk_is_refused(tmp_path):
    from syncd.records.replay import ReplayFormatError

    store = Store(tmp_path)
    rec = ReplayRecorder(store, "r", vocab_size=100, chunk_tokens=3)
    _add(rec, "a", 0, 9)
    _add(rec, "b", 0, 2)
    rec.close()
    keys = sorted(k for k in rec.written if "/replay/a/" in k)
    sizes = [len(store.get(k)) for k in keys]
    assert len(read_request(store, "r", "a", max_bytes=sum(sizes))) == 3
    with pytest.raises(ReplayFormatError, match=f"past the {sum(sizes) - 1} bytes"):
        read_request(store, "r", "a", max_bytes=sum(sizes) - 1)
    # a chunk of request b put under a's key (a hostile or broken writer) names itself, never read as a's
    foreign = next(k for k in rec.written if "/replay/b/" in k)
    store.put(keys[0].rsplit("/", 1)[0] + "/ffffffffffffffff-000000000099.srpl", store.get(foreign))
    with pytest.raises(ReplayFormatError, match="a chunk of request 'b' under the key of request 'a'"):
        read_request(store, "r", "a")
