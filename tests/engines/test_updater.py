"""syncd.engines.WeightUpdater / StateDictEngine on real AdamW deltas of a tiny Qwen2: 1:1, fused (qkv, gate_up) and
tensor-parallel sliced parameters against slicing the trainer's tensors, rollback, all-or-nothing."""

from __future__ import annotations

import pytest
import torch

from syncd.engine import StateDictEngine
from syncd.engine.sharding import tp_specs
from syncd.engines.params import (ParamPiece, ParamSpec, bf16_view_of_fp32, build_local, expected_checksums,
                                  map_positions)
from syncd.engines.update import Update
from syncd.engines.updater import WeightUpdater
from syncd.errors import DeltaError, IntegrityError
from syncd.ops import checksum, delta
from tests.store._models import bits, trajectory

HEADS, KV = 4, 2


def _delta_update(states, v, version: int = 1, **kw) -> Update:
    return Update(v, "delta", {k: delta.encode(states[v - 1][k], states[v][k], version=version) for k in states[0]},
                  base_version=v - 1, **kw)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def _by_hand(full: dict, rank: int, world: int = 2) -> dict[str, torch.Tensor]:
    """What rank ``rank`` must hold, by slicing the trainer's tensors directly (independent of the specs)."""
    out = {}
    for name, t in full.items():
        r, W = rank, world
        rows = lambda x: x[r * x.shape[0] // W:(r + 1) * x.shape[0] // W]  # noqa: E731
        if ".self_attn.q_proj." in name:
            pre, kind = name.split(".self_attn.q_proj.")
            parts = [full[f"{pre}.self_attn.{w}_proj.{kind}"] for w in "qkv"]
            out[f"{pre}.self_attn.qkv_proj.{kind}"] = torch.cat([rows(p) for p in parts])
        elif ".mlp.gate_proj." in name:
            pre = name.split(".mlp.gate_proj.")[0]
            out[f"{pre}.mlp.gate_up_proj.weight"] = torch.cat([rows(full[f"{pre}.mlp.{w}_proj.weight"])
                                                               for w in ("gate", "up")])
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            out[name] = t[:, r * t.shape[1] // W:(r + 1) * t.shape[1] // W]
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            out[name] = rows(t)
        elif "norm" in name:
            out[name] = t
    return out


@pytest.fixture(scope="module")
def states():
    return trajectory(5)


def test_tp_ranks_with_fused_qkv_gate_up_follow_real_deltas(states):
    ranks = [StateDictEngine.from_full(states[0], tp_specs(states[0], rank=r, world_size=2, num_heads=HEADS,
                                                           num_kv_heads=KV), 0) for r in range(2)]
    for r, eng in enumerate(ranks):
        want = _by_hand(states[0], r)
        assert set(eng.state_dict()) == set(want)
        assert all(_same(eng.state_dict()[k], want[k].contiguous()) for k in want)
    for v in range(1, 5):
        upd = _delta_update(states, v)
        for r, eng in enumerate(ranks):
            eng.stage(upd)
            eng.pause()
            eng.apply()
            eng.resume()
            assert eng.version == v
            want = _by_hand(states[v], r)
            for k, t in eng.state_dict().items():
                assert _same(t, want[k].contiguous()), (v, r, k)
            assert eng.checksum() == expected_checksums(eng.parameters(), states[v])
    # the two ranks together hold every changed word exactly once: the update was not thinned
    changed = sum(int((bits(states[3][k]) != bits(states[4][k])).sum()) for k in states[0]
                  if "norm" not in k)
    staged = sum(p.index.numel() for e in ranks for p in e.updater.last_applied.params if "norm" not in p.name)
    assert staged == changed > 0


def test_format2_context_blocks_decode_against_the_engines_own_fused_and_fp32_weights(states):
    """Format-2 deltas need the old tensor: a single-rank engine holds every trainer tensor whole (fused qkv and
    gate_up slabs, bf16 words inside fp32 weights) and decodes them against its own weights, bit for bit."""
    fused = StateDictEngine.from_full(states[0], tp_specs(states[0], rank=0, world_size=1, num_heads=HEADS,
                                                          num_kv_heads=KV), 0)
    fp32 = {k: v.float() for k, v in states[0].items()}
    in_fp32 = StateDictEngine({k: bf16_view_of_fp32(v) for k, v in fp32.items()}, 0)
    for v in range(1, 5):
        upd = _delta_update(states, v, version=2)
        assert sum(delta.needs_base(b) for b in upd.tensors.values()) >= 8  # the matrices' blobs
        for eng in (fused, in_fp32):
            eng.stage(upd)
            eng.pause()
            eng.apply()
            eng.resume()
        want = _by_hand(states[v], 0, world=1)
        assert all(_same(t, want[k].contiguous()) for k, t in fused.state_dict().items())
        assert all(torch.equal(fp32[k], states[v][k].float()) for k in fp32)
    assert fused.checksum() == expected_checksums(fused.parameters(), states[4])


def test_a_tensor_parallel_rank_refuses_format2_for_a_slice_and_takes_format1_for_it(states):
    """A rank holding a slice of a tensor cannot decode its context blocks: stage refuses the update, naming the
    tensor and the remedy, and changes nothing; with the sliced tensors published in format 1 (what
    ``WeightPublisher(delta_format=2, sliced_tensors=...)`` writes) it follows the run bit for bit."""
    from syncd.publish.shard_writer import delta_formats

    specs = tp_specs(states[0], rank=1, world_size=2, num_heads=HEADS, num_kv_heads=KV)
    eng = StateDictEngine.from_full(states[0], specs, 0)
    before = {k: t.clone() for k, t in eng.state_dict().items()}
    with pytest.raises(DeltaError, match=r"tensor 'model\.\S+': its delta has context blocks \(format 2\).*holds "
                                         r"only \[\d+:\d+\) of dim \d.*format 1"):
        eng.stage(_delta_update(states, 1, version=2))
    assert eng.version == 0 and all(_same(t, before[k]) for k, t in eng.state_dict().items())
    pick = delta_formats(2, sliced_tensors=r".*_proj\.(weight|bias)|model\.embed_tokens\.weight|lm_head\.weight")
    for v in range(1, 4):
        upd = Update(v, "delta", {k: delta.encode(states[v - 1][k], states[v][k], version=pick(k)) for k in states[0]},
                     base_version=v - 1)
        eng.stage(upd)
        eng.pause()
        eng.apply()
        eng.resume()
        want = _by_hand(states[v], 1)
        assert all(_same(t, want[k].contiguous()) for k, t in eng.state_dict().items())


def test_map_positions_of_3d_slices_and_fused_pieces():
    g = torch.Generator().manual_seed(1)
    E, R, C = 4, 6, 5
    a_old = torch.randn(E, R, C, generator=g).to(torch.bfloat16)
    b_old = torch.randn(E, R, C, generator=g).to(torch.bfloat16)
    a_new, b_new = a_old.clone(), b_old.clone()
    for t in (a_new, b_new):
        m = torch.rand(E, R, C, generator=g) < 0.3
        t[m] += 1
    # local = [a rows 2..5 | b rows 0..3] along dim 1 (like an expert-sliced fused gate_up)
    spec = ParamSpec("fused", torch.bfloat16, (E, 6, C), "cpu",
                     (ParamPiece("a", (E, R, C), 1, 2, 5, 0), ParamPiece("b", (E, R, C), 1, 0, 3, 3)))
    up = WeightUpdater([spec], {"fused": build_local(spec, {"a": a_old, "b": b_old})}, version=0)
    up.stage(Update(1, "delta", {"a": delta.encode(a_old, a_new), "b": memoryview(delta.encode(b_old, b_new))},
                    base_version=0))
    up.apply()
    assert _same(up.tensors()["fused"], torch.cat([a_new[:, 2:5], b_new[:, 0:3]], dim=1))
    keep, local = map_positions(torch.arange(E * R * C), spec.pieces[0], spec.shape)
    assert int(keep.sum()) == E * 3 * C and torch.all(local[1:] > local[:-1])


def test_rollback_is_bit_exact_and_restores_the_version(states, write_mode):
    eng = StateDictEngine({k: v.clone() for k, v in states[1].items()}, 1)
    eng.stage(_delta_update(states, 2))
    eng.pause()
    eng.apply()
    assert all(_same(eng.state_dict()[k], states[2][k]) for k in states[2])
    eng.rollback()
    assert eng.version == 1
    assert all(_same(eng.state_dict()[k], states[1][k]) for k in states[1])
    with pytest.raises(RuntimeError, match="no applied update"):
        eng.rollback()


def test_corrupt_blob_is_refused_at_stage_and_nothing_changes(states):
    eng = StateDictEngine({k: v.clone() for k, v in states[0].items()}, 0)
    upd = _delta_update(states, 1)
    last = list(upd.tensors)[-1]
    bad = bytearray(upd.tensors[last])
    bad[len(bad) // 2] ^= 0x10
    upd.tensors[last] = bytes(bad)
    before = eng.checksum()
    with pytest.raises(DeltaError, match=last.replace(".", r"\.")):
        eng.stage(upd)
    assert eng.updater.staged is None and eng.checksum() == before and eng.version == 0


@pytest.fixture(params=["serial", "parallel", "torch"])
def write_mode(request, monkeypatch):
    """Run a test with the native scatter (syncd.ops.scatter_words_) on the calling thread, split over the pool
    in small runs, or through the torch path GPU parameters take (batched compares, one synchronisation, then
    writes)."""
    import syncd.engines.staging as staging
    import syncd.ops.scatter as scatter

    if request.param == "parallel":
        monkeypatch.setattr(scatter, "_PARALLEL_MIN", 0)
        monkeypatch.setattr(scatter, "_RUN", 64)
    if request.param == "torch":
        monkeypatch.setattr(staging, "_NATIVE_SCATTER", False)
    return request.param


def test_apply_is_all_or_nothing_when_a_parameter_changed_after_stage(states, write_mode):
    eng = StateDictEngine({k: v.clone() for k, v in states[0].items()}, 0)
    eng.stage(_delta_update(states, 1))
    staged = eng.updater.staged
    victim = staged.params[-1]
    t = eng.state_dict()[victim.name].view(-1)
    t[int(victim.index[0])] = t[int(victim.index[0])] + 1  # an out-of-band write after stage
    before = {k: v.clone() for k, v in eng.state_dict().items()}
    eng.pause()
    with pytest.raises(DeltaError, match="changed since"):
        eng.apply()
    assert eng.version == 0
    assert all(_same(eng.state_dict()[k], before[k]) for k in before)


def test_a_failure_midway_through_the_write_restores_every_written_parameter(states, write_mode):
    up = WeightUpdater(*_identity(states[0]), version=0)
    up.stage(_delta_update(states, 1))
    s = up.staged
    assert len(s.params) > 3
    last = s.params[-1]
    last.index = last.index.clone()
    last.index[-1] = 1 << 40  # the write of the last parameter fails after the others were written
    with pytest.raises(DeltaError, match="outside the tensor"):
        up.apply(verify=False)
    assert up.version == 0
    assert all(_same(up.tensors()[k], states[0][k]) for k in states[0])


def _identity(state):
    from syncd.engines.params import identity_specs
    tensors = {k: v.clone() for k, v in state.items()}
    return identity_specs(tensors), tensors


def test_base_version_mismatch_names_both_versions(states):
    eng = StateDictEngine({k: v.clone() for k, v in states[0].items()}, 0)
    with pytest.raises(ValueError, match=r"base version 1.*holds version 0"):
        eng.stage(_delta_update(states, 2))


def test_unknown_names_wrong_shapes_and_checksums_are_refused(states):
    eng = StateDictEngine({k: v.clone() for k, v in states[0].items()}, 0)
    upd = _delta_update(states, 1)
    with pytest.raises(DeltaError, match="does not hold"):
        eng.stage(Update(1, "delta", {**upd.tensors, "extra.weight": b"x"}, base_version=0))
    k = "model.layers.0.self_attn.q_proj.weight"
    other = "model.layers.0.self_attn.k_proj.weight"
    with pytest.raises(DeltaError, match="blob is for"):
        eng.stage(Update(1, "delta", {k: upd.tensors[other]}, base_version=0))
    with pytest.raises(DeltaError, match="result checksum"):
        eng.stage(Update(1, "delta", {k: upd.tensors[k]}, base_version=0, checksums={k: 12345}))
    with pytest.raises(DeltaError, match="base checksum|wrong base"):  # a blob made against other weights
        eng.stage(Update(1, "delta", {k: delta.encode(states[2][k], states[3][k])}, base_version=0))
    # a rank holding none of a tensor accepts updates that name it
    ignoring = StateDictEngine({k: v.clone() for k, v in states[0].items() if k != k}, 0,
                               ignore_sources=list(states[0]))
    ignoring.stage(upd)
    assert ignoring.updater.staged.changed == 0


def test_stale_stage_after_rollback_is_refused(states):
    eng = StateDictEngine({k: v.clone() for k, v in states[0].items()}, 0)
    eng.stage(_delta_update(states, 1))
    eng.pause()
    eng.apply()
    eng.stage(_delta_update(states, 2))
    eng.rollback()
    with pytest.raises(DeltaError, match="stage it again"):
        eng.apply()
    assert eng.version == 0


def test_full_versions_stage_apply_rollback_and_load_full(states):
    specs = tp_specs(states[0], rank=1, world_size=2, num_heads=HEADS, num_kv_heads=KV)
    eng = StateDictEngine.from_full(states[0], specs, 0)
    ck = {k: checksum(v) for k, v in states[3].items()}
    eng.stage(Update(3, "full", dict(states[3]), checksums=ck))
    eng.pause()
    eng.apply()
    assert eng.version == 3 and eng.checksum() == expected_checksums(specs, states[3])
    assert eng.updater.last_applied.expected_checksums == eng.checksum()
    eng.rollback()
    assert eng.checksum() == expected_checksums(specs, states[0])
    # load_full validates everything first
    before = eng.checksum()
    with pytest.raises(IntegrityError, match="checksum"):
        eng.load_full(Update(4, "full", dict(states[4]), checksums={**ck}))
    missing = dict(states[4])
    missing.pop("model.norm.weight")
    with pytest.raises(DeltaError, match="lacks tensor 'model.norm.weight'"):
        eng.load_full(Update(4, "full", missing))
    assert eng.checksum() == before and eng.version == 0
    eng.load_full(Update(4, "full", dict(states[4])))
    assert eng.version == 4 and eng.checksum() == expected_checksums(specs, states[4])
    with pytest.raises(RuntimeError):
        eng.rollback()


def test_apply_needs_pause_and_a_staged_update(states):
    eng = StateDictEngine({k: v.clone() for k, v in states[0].items()}, 0)
    eng.stage(_delta_update(states, 1))
    with pytest.raises(RuntimeError, match="pause"):
        eng.apply()
    eng.pause()
    eng.apply()
    with pytest.raises(RuntimeError, match="nothing is staged"):
        eng.apply()


def test_bf16_words_inside_fp32_weights_update_the_fp32_values(states):
    fp32 = {k: v.float() for k, v in states[0].items()}
    views = {k: bf16_view_of_fp32(v) for k, v in fp32.items()}
    assert all(_same(views[k].contiguous(), states[0][k]) for k in views)
    eng = StateDictEngine(views, 0)
    assert eng.checksum() == {k: checksum(v) for k, v in states[0].items()}
    for v in (1, 2):
        eng.stage(_delta_update(states, v))
        eng.pause()
        eng.apply()
        eng.resume()
        assert all(torch.equal(fp32[k], states[v][k].float()) for k in fp32)
    assert eng.checksum() == {k: checksum(v) for k, v in states[2].items()}


def test_specs_must_tile_the_local_tensor():
    t = torch.zeros(4, 3)
    gap = ParamSpec("p", torch.float32, (4, 3), "cpu", (ParamPiece("a", (4, 3), 0, 0, 2, 0),))
    with pytest.raises(ValueError, match="cover"):
        WeightUpdater([gap], {"p": t})
    overlap = ParamSpec("p", torch.float32, (4, 3), "cpu", (ParamPiece("a", (4, 3), 0, 0, 3, 0),
                                                            ParamPiece("b", (4, 3), 0, 0, 2, 2)))
    with pytest.raises(ValueError, match="two pieces"):
        WeightUpdater([overlap], {"p": t})
    with pytest.raises(ValueError, match="spec says"):
        WeightUpdater([ParamSpec("p", torch.bfloat16, (4, 3), "cpu", (ParamPiece("p", (4, 3)),))], {"p": t})


@pytest.mark.parametrize("dtype", [torch.int16, torch.int32, torch.int64])
def test_fingerprint_catches_any_one_word_and_counts_positions(dtype):
    from syncd.engines.staging import fingerprint

    g = torch.Generator().manual_seed(0)
    words = torch.randint(-1000, 1000, (5000,), generator=g).to(dtype)
    index = torch.sort(torch.randperm(1 << 20, generator=g)[:5000]).values.to(torch.int32)
    base = fingerprint(words, index)
    assert base == fingerprint(words.clone(), index.to(torch.int64))  # index width does not matter
    for j in [0, 1, 2, 2500, 4999]:
        for delta in [1, -1, 1 << 12]:
            w = words.clone()
            w[j] += delta
            assert fingerprint(w, index) != base
    swapped = index.clone()
    swapped[[10, 11]] = swapped[[11, 10]]
    assert fingerprint(words, swapped) != base


@pytest.mark.parametrize("version", [1, 2])
def test_stage_decodes_each_blob_once_and_copies_no_tensor(states, version, monkeypatch):
    """A 1:1 parameter is staged from its change list (delta.changed_words checks both checksums), not decoded
    a second time on a copy of the tensor; its header is parsed once (each parse checksums it: ~10% of a stage
    when it was three times)."""
    from syncd.ops import _format

    decoded, parsed = [], []
    real_changes, real_parse = delta.changes, _format.parse_header
    monkeypatch.setattr(delta, "changes", lambda blob, base=None: decoded.append(1) or real_changes(blob, base))
    monkeypatch.setattr(_format, "parse_header", lambda *a: parsed.append(1) or real_parse(*a))
    monkeypatch.setattr(delta, "decode", lambda *a, **k: pytest.fail("stage decoded a blob on a copy"))
    monkeypatch.setattr(delta, "apply_", lambda *a, **k: pytest.fail("stage applied a blob to a copy"))
    eng = StateDictEngine({k: v.clone() for k, v in states[1].items()}, 1)
    upd = _delta_update(states, 2, version=version)
    eng.stage(upd)
    assert len(decoded) == len(upd.tensors)
    assert len(parsed) == len(upd.tensors)
    eng.pause()
    eng.apply()
    assert all(_same(eng.state_dict()[k], states[2][k]) for k in states[2])


def test_the_written_hook_sees_every_write_and_a_failing_hook_undoes_the_apply(states):
    """The engine's hook for written parameters runs inside apply / rollback / load_full with the positions written
    and the update applied; when it raises after an apply, the words and the hook are put back as before."""
    calls, fail = [], [False]

    def written(positions, applied):
        calls.append((None if positions is None else {k: v.clone() for k, v in positions.items()}, applied))
        if fail[0]:
            fail[0] = False
            raise OSError("refresh failed")

    up = WeightUpdater(*_identity(states[0]), version=0, written=written)
    up.stage(_delta_update(states, 1))
    staged = up.staged
    up.apply()
    assert len(calls) == 1 and calls[0][1] is staged
    assert {k: v.tolist() for k, v in calls[0][0].items()} == {p.name: p.index.tolist() for p in staged.params}
    assert up.rollback() == 0 and calls[1][1] is None and calls[1][0].keys() == calls[0][0].keys()

    up.stage(_delta_update(states, 1))
    fail[0] = True
    with pytest.raises(OSError, match="refresh failed"):
        up.apply()
    assert up.version == 0 and up.last_applied is None and len(calls) == 4
    assert calls[2][1] is not None and calls[3][1] is None  # the failed refresh, then the one for the old words
    assert all(_same(up.tensors()[k], states[0][k]) for k in states[0])

    up.load_full(Update(3, "full", {k: v.clone() for k, v in states[3].items()}))
    assert calls[-1] == (None, None) and up.version == 3
