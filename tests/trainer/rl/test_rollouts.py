"""``syncd.trainer.rl.rollouts.read_rollouts`` on records written by real reference engines (in process) to a real file
store: a request migrated between two engines (two writers, two segments, the first engine's undelivered
tokens ignored), multi-turn merging, and every kind of corrupt, missing or mismatched record refused with a
named error (or dropped and counted); kept sets recorded to be rebuilt read back pending and rebuild, from the
trainer's logits, to exactly the sets an explicit recorder of the same engine listed; logits of other weights are
refused with a named error (or the tokens dropped and counted), never given another set."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from syncd.engines.protocol import GenerationRequest, SamplingParams
from syncd.engine.proxy.record import Trajectory, Turn
from syncd.engine.reference import ReferenceEngine
from syncd.engine.replay import ReplayRecorder
from syncd.ops.replay import NO_ROUTE
from syncd.records.replay import ReplayFormatError, decode_chunk, encode_chunk
from syncd.store import Store
from syncd.trainer.rl.batch import collate
from tests.engine.conftest import dense_dir, moe_dir  # noqa: F401 -- the tiny model folders
from syncd.trainer.rl.rollouts import (NO_VERSION, KeptSetError, MissingReplayError, RecordMismatchError, RouteError,
                                       SegmentGapError, read_rollouts)

PROMPT = [257, 84, 82, 68, 81, 198, 71]
SP = SamplingParams(max_tokens=14, temperature=1.0, top_p=0.8, top_k=20, seed=9)


DELTA = 1e-3


class _Tee:
    """Two recorders fed by one engine: every token recorded by both (here: listed, and to be rebuilt)."""

    def __init__(self, *recorders):
        self.recorders = recorders

    def __getattr__(self, name):
        return lambda *a, **k: [getattr(r, name)(*a, **k) for r in self.recorders][0]


def _generate(model_dir, store, rid, prompt, sp, *, version=0, rebuild_store=None):
    """Generate with a recorder listing every kept set into ``store`` (and, given ``rebuild_store``, another one
    recording sets to rebuild, with tolerance DELTA, there)."""
    rec = ReplayRecorder(store, "r", chunk_tokens=5)
    both = rec if rebuild_store is None else _Tee(rec, ReplayRecorder(rebuild_store, "r", chunk_tokens=5,
                                                                       kept_tolerance=DELTA))
    with ReferenceEngine.from_pretrained(model_dir, version=version, recorder=both) as eng:
        events = eng.generate_sync(GenerationRequest(rid, tuple(prompt), sp), timeout=120)
    both.close()
    return [e.token_id for e in events], [e.logprob for e in events]


def _turn(index, prompt, out, lps, segments, versions, temperature=1.0):
    return Turn(index, "completions", {"temperature": temperature}, True, status="ok", prompt_token_ids=list(prompt),
                output_token_ids=list(out), versions=list(versions), logprobs=list(lps), finish_reason="length",
                request_id=segments[0]["request_id"], segments=segments)


def _write(store, turns, tid="t1"):
    for st in store if isinstance(store, tuple) else (store,):
        t = Trajectory("r", "sb", tid)
        t.turns.extend(turns)
        st.put(t.key, t.encode(), create=True)


@pytest.fixture(params=["dense", "moe"])
def migrated(request, dense_dir, moe_dir, tmp_path):
    """A request whose first engine died after delivering 8 of its 12 tokens; a second engine continued it
    from the prompt plus those 8 (as Dynamo migrates it), under the same request id. Recorded twice: every kept
    set listed (``store``), and sets to rebuild (``rebuild``)."""
    model_dir = dense_dir if request.param == "dense" else moe_dir
    store, rebuild = Store(tmp_path / "store"), Store(tmp_path / "rebuild")
    first, lp1 = _generate(model_dir, store, "req-m", PROMPT, SamplingParams(**{**SP.__dict__, "max_tokens": 12}),
                           rebuild_store=rebuild)
    second, lp2 = _generate(model_dir, store, "req-m", PROMPT + first[:8], SamplingParams(**{**SP.__dict__,
                                                                                            "max_tokens": 6}),
                            rebuild_store=rebuild)
    out, lps = first[:8] + second, lp1[:8] + lp2
    segs = [{"request_id": "req-m", "start": 0, "count": 8}, {"request_id": "req-m", "start": 8, "count": 6}]
    _write((store, rebuild), [_turn(0, PROMPT, out, lps, segs, [0] * 14)])
    return store, out, request.param, model_dir, rebuild


def test_a_migrated_request_reads_back_from_both_engines(migrated):
    store, out, kind, _, _ = migrated
    rs = read_rollouts(store, "r")
    assert not rs.dropped and len(rs.rollouts) == 1
    (seq,) = rs.rollouts[0].sequences
    T = len(PROMPT) + 14
    assert seq.tokens.tolist() == PROMPT + out and len(seq) == T
    assert seq.loss_mask.tolist() == [False] * len(PROMPT) + [True] * 14
    assert seq.positions.tolist() == list(range(len(PROMPT), T))
    assert seq.versions[seq.loss_mask].tolist() == [0] * 14 and (seq.versions[~seq.loss_mask] == NO_VERSION).all()
    assert (seq.logprobs[seq.loss_mask] < 0).all() and seq.logprobs[~seq.loss_mask].eq(0).all()
    sizes = seq.kept_offsets[1:] - seq.kept_offsets[:-1]
    assert sizes.numel() == 14 and (sizes >= 1).all() and seq.kept_ids.dtype == torch.int32
    for j, pos in enumerate(seq.positions.tolist()):
        kept = seq.kept_ids[seq.kept_offsets[j]:seq.kept_offsets[j + 1]]
        assert int(seq.tokens[pos]) in kept.tolist() and bool((kept[1:] > kept[:-1]).all())
    assert (seq.row_versions[:T - 1] == 0).all() and seq.row_versions[T - 1] == NO_VERSION
    if kind == "moe":
        assert seq.routes.shape == (T, 2, 2) and seq.routes.dtype == torch.int8 and seq.num_experts == 8
        assert (seq.routes[:T - 1] >= 0).all() and (seq.routes[T - 1] == NO_ROUTE).all()  # never ran
        assert seq.route_conflicts == 0  # the second engine's re-prefill routed those positions alike
    else:
        assert seq.routes is None and seq.num_experts == 0
    batch = collate(rs.sequences + rs.sequences[:1])
    assert batch.input_ids.shape == (2, T) and batch.rows.tolist()[:2] == [len(PROMPT) - 1, len(PROMPT)]
    assert batch.rows.tolist()[14] == T + len(PROMPT) - 1 and batch.kept_offsets[-1] == 2 * seq.kept_ids.numel()


def test_turns_that_extend_each_other_merge_into_one_sequence(dense_dir, tmp_path):
    store = Store(tmp_path / "store")
    out1, lp1 = _generate(dense_dir, store, "turn-1", PROMPT, SP)
    prompt2 = PROMPT + out1 + [198, 72, 73]
    out2, lp2 = _generate(dense_dir, store, "turn-2", prompt2, SP)
    other, lp3 = _generate(dense_dir, store, "turn-3", [257, 90], SP)
    seg = lambda rid: [{"request_id": rid, "start": 0, "count": 14}]  # noqa: E731
    _write(store, [_turn(0, PROMPT, out1, lp1, seg("turn-1"), [0] * 14),
                   _turn(1, prompt2, out2, lp2, seg("turn-2"), [0] * 14),
                   _turn(2, [257, 90], other, lp3, seg("turn-3"), [0] * 14)])
    seqs = read_rollouts(store, "r").sequences
    assert [s.turns for s in seqs] == [[0, 1], [2]]
    merged = seqs[0]
    assert merged.tokens.tolist() == prompt2 + out2
    want = np.zeros(len(prompt2) + 14, dtype=bool)
    want[len(PROMPT):len(PROMPT) + 14] = True
    want[len(prompt2):] = True
    assert merged.loss_mask.numpy().tolist() == want.tolist() and merged.request_ids == ["turn-1", "turn-2"]
    assert read_rollouts(store, "r", merge_turns=False).rollouts[0].sequences.__len__() == 3


@pytest.fixture
def dense_run(dense_dir, tmp_path):
    store = Store(tmp_path / "store")
    out, lps = _generate(dense_dir, store, "req-d", PROMPT, SP)
    segs = [{"request_id": "req-d", "start": 0, "count": 14}]
    _write(store, [_turn(0, PROMPT, out, lps, segs, [0] * 14)])
    return store, out, lps


def _chunk_keys(store):
    return sorted(o.key for o in store.list("runs/r/replay/") if o.key.endswith(".srpl"))


def _rewrite_chunk(store, key, fn):
    chunk = decode_chunk(store.get(key))
    fn(chunk)
    store.delete([key])
    store.put(key, encode_chunk(chunk), create=True)


def _rewrite_record(store, fn, tid="t1"):
    key = f"runs/r/trajectories/sb/{tid}.json"
    doc = json.loads(store.get(key))
    fn(doc)
    store.delete([key])
    store.put(key, json.dumps(doc).encode(), create=True)


def test_corrupt_missing_and_mismatched_records_raise_named_errors(dense_run):
    store, out, lps = dense_run
    keys = _chunk_keys(store)
    assert len(keys) == 3  # 14 tokens in chunks of 5
    raw = bytearray(store.get(keys[1]))
    raw[20] ^= 0x40
    store.delete([keys[1]])
    store.put(keys[1], bytes(raw), create=True)
    with pytest.raises(ReplayFormatError, match="checksum"):
        read_rollouts(store, "r")
    rs = read_rollouts(store, "r", on_error="drop")
    assert rs.dropped == {"ReplayFormatError": 1} and not rs.rollouts and rs.errors[0][:2] == ("sb", "t1")
    store.delete([keys[1]])
    with pytest.raises(MissingReplayError, match="output token 5 .* has no replay record"):
        read_rollouts(store, "r")


def test_mismatched_and_hostile_content_is_refused(dense_run):
    store, out, lps = dense_run
    keys = _chunk_keys(store)
    _rewrite_record(store, lambda d: d["turns"][0]["output_token_ids"].__setitem__(3, (out[3] + 1) % 320))
    with pytest.raises(RecordMismatchError, match="position 10: the replay record has token"):
        read_rollouts(store, "r")
    _rewrite_record(store, lambda d: d["turns"][0]["output_token_ids"].__setitem__(3, out[3]))
    _rewrite_record(store, lambda d: d["turns"][0]["versions"].__setitem__(5, 7))
    with pytest.raises(RecordMismatchError, match="of version 0, the trajectory token .* of version 7"):
        read_rollouts(store, "r")
    _rewrite_record(store, lambda d: d["turns"][0]["versions"].__setitem__(5, 0))
    _rewrite_record(store, lambda d: d["turns"][0]["logprobs"].__setitem__(2, lps[2] - 0.5))
    with pytest.raises(RecordMismatchError, match="log-prob"):
        read_rollouts(store, "r")
    _rewrite_record(store, lambda d: d["turns"][0]["logprobs"].__setitem__(2, lps[2]))
    _rewrite_record(store, lambda d: d["turns"][0].update(segments=[{"request_id": "req-d", "start": 0, "count": 6},
                                                                    {"request_id": "req-d", "start": 7, "count": 8}]))
    with pytest.raises(SegmentGapError, match="does not start at output token 6"):
        read_rollouts(store, "r")
    _rewrite_record(store, lambda d: d["turns"][0].update(segments=[{"request_id": "req-d", "start": 0,
                                                                     "count": 14}]))
    read_rollouts(store, "r")  # whole again

    def drop_sampled(chunk):
        r = chunk.records[1]
        r.kept = np.array([i for i in range(320) if i != r.token_id][:3])

    _rewrite_chunk(store, keys[0], drop_sampled)
    with pytest.raises(KeptSetError, match="position 8: the kept set .* does not contain the sampled token"):
        read_rollouts(store, "r")
    assert read_rollouts(store, "r", on_error="drop").dropped == {"KeptSetError": 1}
    _rewrite_chunk(store, keys[0], lambda c: setattr(c.records[1], "kept", np.arange(320)))
    assert len(read_rollouts(store, "r").sequences) == 1
    with pytest.raises(RecordMismatchError, match="records of vocabulary 320, the model has 256"):
        read_rollouts(store, "r", vocab_size=256)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_log_prob_or_temperature_is_refused_by_name(dense_run, bad):
    """One NaN (or +-inf) engine log-prob used to pass every read check and raise ValueError inside the training
    step: the run died, and every --resume put the same group back. It is refused when the record is read, as a
    NonFiniteError naming the position (or dropped and counted), in the replay record or the trajectory, and so is a
    non-finite sampling temperature (which JSON cannot carry: the record reader refuses it first)."""
    from syncd.records.trajectory import RecordError
    from syncd.trainer.rl.rollouts import NonFiniteError

    store, out, lps = dense_run
    keys = _chunk_keys(store)
    _rewrite_chunk(store, keys[1], lambda c: setattr(c.records[2], "logprob", bad))
    with pytest.raises(NonFiniteError, match=rf"sb/t1 turn 0: position 14: log-prob {bad} in the replay record"):
        read_rollouts(store, "r")
    rs = read_rollouts(store, "r", on_error="drop")
    assert rs.dropped == {"NonFiniteError": 1} and not rs.rollouts
    _rewrite_chunk(store, keys[1], lambda c: setattr(c.records[2], "logprob", lps[7]))
    assert len(read_rollouts(store, "r").sequences) == 1
    for fn in (lambda d: d["turns"][0]["logprobs"].__setitem__(7, bad),
               lambda d: d["turns"][0]["request"].__setitem__("temperature", bad)):
        _rewrite_record(store, fn)  # (the strict JSON reader refuses them before the rollout reader could)
        with pytest.raises((NonFiniteError, RecordError), match="not a JSON value|overflows|must be finite") as err:
            read_rollouts(store, "r")
        assert read_rollouts(store, "r", on_error="drop").dropped == {type(err.value).__name__: 1}
        _rewrite_record(store, lambda d: (d["turns"][0]["logprobs"].__setitem__(7, lps[7]),
                                          d["turns"][0]["request"].__setitem__("temperature", 1.0)))
        assert len(read_rollouts(store, "r").sequences) == 1


def test_moe_routes_that_do_not_fit_the_model_are_refused(moe_dir, tmp_path):
    store = Store(tmp_path / "store")
    out, lps = _generate(moe_dir, store, "req-e", PROMPT, SP)
    _write(store, [_turn(0, PROMPT, out, lps, [{"request_id": "req-e", "start": 0, "count": 14}], [0] * 14)])
    assert read_rollouts(store, "r", num_experts=8).sequences[0].routes.shape[1:] == (2, 2)
    with pytest.raises(RouteError, match="route among 8 experts, the model has 4"):
        read_rollouts(store, "r", num_experts=4)
    keys = _chunk_keys(store)

    def sixteen(chunk):  # a chunk claiming 16 experts, its routes up to 15
        chunk.num_experts = 16
        for r in chunk.records:
            r.routing = np.asarray(r.routing) + 8

    _rewrite_chunk(store, keys[1], sixteen)
    with pytest.raises(RouteError, match="records with 16 and 8 experts"):
        read_rollouts(store, "r")
    _rewrite_chunk(store, keys[1], lambda c: [setattr(c, "num_experts", 8)] + [
        setattr(r, "routing", np.asarray(r.routing) - 8) for r in c.records])

    def set_first_routes(routes):
        def fn(chunk):
            chunk.records[0].routing = np.asarray(routes)
        return fn

    _rewrite_chunk(store, keys[2], set_first_routes([[3, 3], [1, 2]]))
    with pytest.raises(RouteError, match="an expert appears twice"):
        read_rollouts(store, "r")
    _rewrite_chunk(store, keys[2], set_first_routes([[3, 4], [1, 2]]))
    read_rollouts(store, "r")
    _rewrite_chunk(store, keys[0], lambda chunk: setattr(chunk, "prompt_routing", None))
    with pytest.raises(MissingReplayError, match="position\\(s\\) have no routes \\(first: 0\\)"):
        read_rollouts(store, "r")


def test_trainer_logprobs_with_sparse_lm_head_gradients_equal_the_full_logits_path(migrated):
    from transformers import AutoModelForCausalLM

    from syncd.trainer.rl.logprobs import trainer_logprobs

    store, out, kind, folder, _ = migrated
    seqs = read_rollouts(store, "r").sequences
    batch = collate(seqs + seqs)
    grads, lps = [], []
    for use_head in (True, False):
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
        if not use_head:
            model.get_output_embeddings = lambda: None  # force the full-logits path
        r = trainer_logprobs(model, batch)
        (r.logprobs * torch.linspace(-1, 1, r.logprobs.numel())).sum().backward()
        lps.append(r.logprobs.detach())
        grads.append({n: p.grad for n, p in model.named_parameters()})
    torch.testing.assert_close(lps[0], lps[1], atol=1e-6, rtol=0)
    torch.testing.assert_close(lps[0], batch.engine_logprobs, atol=1e-4, rtol=0)  # same weights as the engine
    for n in grads[1]:
        torch.testing.assert_close(grads[0][n], grads[1][n], atol=1e-6, rtol=1e-4)


def _model(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)


def test_sets_to_rebuild_rebuild_to_exactly_the_listed_sets(migrated):
    from syncd.trainer.rl.logprobs import resolve_kept, sampler_logprobs, trainer_logprobs

    store, out, kind, folder, rebuild = migrated
    listed, pending = read_rollouts(store, "r").sequences, read_rollouts(rebuild, "r").sequences
    (a,), (b,) = listed, pending
    assert a.kept_pending is None and b.kept_pending is not None and len(b.kept_pending) >= 3
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs)
    sizes = b.kept_offsets[1:] - b.kept_offsets[:-1]
    later = b.kept_pending.rows
    assert (sizes[later] == 0).all() and (sizes[~torch.isin(torch.arange(14), later)] > 0).all()
    model = _model(folder)
    got = sampler_logprobs(model, b)  # the engine's weights: rebuilt from the recomputed logits
    assert got.kept.rebuilt == len(b.kept_pending) and got.kept.mismatches == 0 and bool(got.kept.valid.all())
    assert torch.equal(got.kept.ids, a.kept_ids.long()) and torch.equal(got.kept.offsets, a.kept_offsets)
    torch.testing.assert_close(got.logprobs, sampler_logprobs(model, a).logprobs, atol=0, rtol=0)
    (resolved,) = resolve_kept(model, pending)
    assert resolved.kept_pending is None and torch.equal(resolved.kept_ids, a.kept_ids)
    # the training path, on a batch of two: rebuilt from the training forward's own rows
    batch_a, batch_b = collate(listed + listed), collate(pending + pending)
    assert torch.equal(batch_b.kept_pending.rows[len(b.kept_pending):], b.kept_pending.rows + 14)
    grads = []
    for batch in (batch_a, batch_b):
        m = _model(folder)
        r = trainer_logprobs(m, batch)
        (r.logprobs * torch.linspace(-1, 1, 28)).sum().backward()
        grads.append((r, {n: p.grad for n, p in m.named_parameters()}))
    (ra, ga), (rb, gb) = grads
    assert rb.kept.rebuilt == 2 * len(b.kept_pending) and torch.equal(rb.kept.ids, ra.kept.ids)
    torch.testing.assert_close(rb.logprobs, ra.logprobs, atol=0, rtol=0)
    torch.testing.assert_close(rb.logprobs.detach(), batch_b.engine_logprobs, atol=1e-4, rtol=0)
    for n in ga:
        torch.testing.assert_close(gb[n], ga[n], atol=0, rtol=0)


def test_logits_of_other_weights_get_a_named_error_never_another_set(migrated):
    from syncd.trainer.rl.kept import KeptRebuildError
    from syncd.trainer.rl.logprobs import trainer_logprobs

    store, out, kind, folder, rebuild = migrated
    (a,), pending = read_rollouts(store, "r").sequences, read_rollouts(rebuild, "r").sequences
    other = _model(folder)
    with torch.no_grad():  # other weights: logits moved far beyond the engine's tolerance
        head = other.get_output_embeddings().weight
        head.add_(torch.randn(head.shape, generator=torch.Generator().manual_seed(0)) * 0.05)
    batch = collate(pending)
    with pytest.raises(KeptRebuildError, match=r"kept sets to rebuild do not match these logits; the first, generated "
                                               r"token \d+ \(sampled with version 0\).*tolerance 0.001"):
        trainer_logprobs(other, batch)
    r = trainer_logprobs(other, batch, on_mismatch="drop")
    bad = ~r.kept.valid
    b = batch.kept_pending
    assert r.kept.mismatches == int(bad.sum()) > 0 and r.kept.rebuilt + r.kept.mismatches == len(b)
    assert bool(torch.isin(b.rows, bad.nonzero()[:, 0]).sum() == bad.sum())  # only rows to rebuild can fail
    assert (r.logprobs[bad] == 0).all()  # the target alone: no gradient, masked by the caller
    truth = a.kept_ids.long()
    for g in (~bad).nonzero()[:, 0].tolist():  # every set that verified is the listed one
        assert torch.equal(r.kept.ids[r.kept.offsets[g]:r.kept.offsets[g + 1]],
                           truth[a.kept_offsets[g]:a.kept_offsets[g + 1]])


def test_the_kept_resolver_rebuilds_from_the_published_version_whatever_the_trainer_holds(migrated):
    """A trainer a version ahead cannot rebuild the sets from its own logits (above); the resolver rebuilds them from
    the published weights of the version that sampled them, read back from the store: exactly the listed sets, while
    the trainer's own weights are neither read nor changed. A version the store does not hold is a named error."""
    from syncd.publish.publisher import WeightPublisher
    from syncd.trainer.rl.kept import KeptRebuildError
    from syncd.trainer.rl.kept_resolver import KeptResolver

    store, out, kind, folder, rebuild = migrated
    (a,), pending = read_rollouts(store, "r").sequences, read_rollouts(rebuild, "r").sequences
    ahead = _model(folder)
    with WeightPublisher(rebuild, "r", signing_key=False) as pub:  # version 0: the folder the engines served
        pub.publish(ahead, 0)
    with torch.no_grad():
        head = ahead.get_output_embeddings().weight
        head.add_(torch.randn(head.shape, generator=torch.Generator().manual_seed(0)) * 0.05)
    before = {n: p.clone() for n, p in ahead.state_dict().items()}
    resolver = KeptResolver(ahead, rebuild, "r", signing_key=False)
    (got,) = resolver(pending)
    assert got.kept_pending is None and torch.equal(got.kept_ids, a.kept_ids) and torch.equal(got.kept_offsets,
                                                                                             a.kept_offsets)
    assert all(torch.equal(p, before[n]) for n, p in ahead.state_dict().items())
    assert resolver.stats() == {"sequences": 1, "versions_loaded": 1}
    assert resolver([a]) == [a] and resolver.stats()["sequences"] == 1  # listed sets: untouched, no work
    (ro,) = resolver.rollouts(read_rollouts(rebuild, "r").rollouts)
    assert torch.equal(ro.sequences[0].kept_ids, a.kept_ids) and resolver.stats()["versions_loaded"] == 1  # cached
    elsewhere = KeptResolver(ahead, store, "r", signing_key=False)  # no version 0 there
    with pytest.raises(KeptRebuildError, match="sampled with version 0 cannot be rebuilt: its weights cannot be read"):
        elsewhere(pending)


def test_format_1_chunks_of_the_previous_release_read_back_alike(dense_run):
    store, out, lps = dense_run
    before = read_rollouts(store, "r").sequences[0]
    for key in _chunk_keys(store):
        old = encode_chunk(decode_chunk(store.get(key)), version=1)
        assert old[4] == 1
        store.delete([key])
        store.put(key, old, create=True)
    after = read_rollouts(store, "r").sequences[0]
    for f in ("tokens", "loss_mask", "versions", "logprobs", "positions", "kept_ids", "kept_offsets", "row_versions"):
        assert torch.equal(getattr(before, f), getattr(after, f)), f
    assert after.kept_pending is None
