"""Kept sets recorded to be rebuilt (format 2): the engine's sampler ranks and records, the trainer rebuilds from
its own logits. Rebuilding is exact for any logits within the recorded tolerance (hypothesis, with ties and
near-ties); fragile boundaries are listed; logits beyond the tolerance are refused, never taken for another
set; hostile blobs are refused."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from syncd.engines.protocol import SamplingParams
from syncd.engine.reference.sampling import sample
from syncd.ops import replay
from syncd.records.replay import KeptToRebuild, ReplayFormatError, decode_kept, encode_kept_record

EXAMPLES = int(os.environ.get("SYNCD_FUZZ_EXAMPLES", "300"))
fuzz = settings(max_examples=max(20, EXAMPLES // 3), deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _record(logits: torch.Tensor, sp: SamplingParams, delta: float, seed: int):
    """What the engine records per row: the sampled token, its kept set (ascending) and the encoded set."""
    out = []
    for t in range(logits.shape[0]):
        s = sample(logits[t], sp, seed, t)
        blob = encode_kept_record(s.ranked.numpy(), s.token_id, logits.shape[1], margins=s.margins.numpy(),
                                  tolerance=delta)
        out.append((s.token_id, s.kept.numpy(), decode_kept(blob, logits.shape[1], token_id=s.token_id,
                                                            tolerance=delta), blob))
    return out


def _rebuild(logits: torch.Tensor, recs, temperature: float, rows):
    sets = [recs[t][2] for t in rows]
    extra_sizes = torch.tensor([k.extra.size for k in sets], dtype=torch.int64)
    return replay.rebuild_kept(logits[rows], torch.tensor([k.top for k in sets]),
                               torch.from_numpy(np.concatenate([k.extra for k in sets])),
                               torch.cat([torch.zeros(1, dtype=torch.int64), extra_sizes.cumsum(0)]),
                               torch.tensor([k.fingerprint for k in sets]), temperature)


@st.composite
def cases(draw):
    V = draw(st.sampled_from([2, 7, 64, 320, 3000]))
    T = draw(st.integers(1, 12))
    seed = draw(st.integers(0, 2**31))
    g = torch.Generator().manual_seed(seed)
    scale = draw(st.sampled_from([0.3, 2.0, 6.0]))
    x = torch.randn(T, V, generator=g) * scale
    if draw(st.booleans()):  # coarse logits: ties and near-ties everywhere
        x = torch.round(x * 4) / 4 + torch.randint(0, 2, (T, V), generator=g) * 1e-4
    temperature = draw(st.sampled_from([0.0, 0.6, 1.0, 1.4]))
    sp = SamplingParams(temperature=temperature, top_k=draw(st.sampled_from([0, 3, 20])),
                        top_p=draw(st.sampled_from([0.5, 0.8, 0.95, 1.0])))
    return x, sp, draw(st.sampled_from([1e-3, 1e-2, 0.1])), seed, draw(st.floats(0.0, 0.9))


@fuzz
@given(cases())
def test_rebuilding_from_logits_within_the_tolerance_gives_the_recorded_set(case):
    x, sp, delta, seed, within = case
    recs = _record(x, sp, delta, seed)
    T = max(sp.temperature, 1e-9) if sp.temperature > 0 else 1.0
    g = torch.Generator().manual_seed(seed + 1)
    trainer = x + (torch.rand(x.shape, generator=g) * 2 - 1) * within * delta * T  # each scaled logit within delta
    rows = [t for t, r in enumerate(recs) if isinstance(r[2], KeptToRebuild)]
    for token, kept, got, blob in recs:
        assert token in kept
        if not isinstance(got, KeptToRebuild):
            assert np.array_equal(got, kept)
            assert len(blob) == 1 or kept.size > 1 or kept[0] != token  # a singleton is the token itself
    if rows:
        rb = _rebuild(trainer, recs, T, rows)
        assert bool((rb.status == replay.REBUILD_OK).all())
        for j, t in enumerate(rows):
            assert np.array_equal(rb.ids[rb.offsets[j]:rb.offsets[j + 1]].numpy(), recs[t][1])


def test_fragile_boundaries_are_listed_and_robust_ones_are_not():
    V, delta = 151936, 1e-3
    x = torch.full((5, V), -10.0)
    ids = [120_000, 99_000, 7, 150_000, 42]
    x[:, ids] = torch.tensor([5.0, 4.0, 3.0005, 3.0, 1.0])  # ranks 3 and 4 within 2 * delta
    x[1, ids] = torch.tensor([5.0, 5.0, 5.0, 5.0, 5.0])  # row 1: five tied at the top
    sp = SamplingParams(temperature=1.0, top_k=2)
    s = sample(x[0], sp, 1, 0)
    blob = encode_kept_record(s.ranked.numpy(), s.token_id, V, margins=s.margins.numpy(), tolerance=delta)
    assert blob[0] == 0x24 and len(blob) == 6  # {99000, 120000}: robust (gap 1 to rank 3): its size and fingerprint
    sp = SamplingParams(temperature=1.0, top_k=3)
    s = sample(x[0], sp, 1, 0)
    got = decode_kept(encode_kept_record(s.ranked.numpy(), s.token_id, V, margins=s.margins.numpy(), tolerance=delta),
                      V, token_id=s.token_id, tolerance=delta)
    assert isinstance(got, KeptToRebuild) and got.top == 2 and got.extra.tolist() == [7]  # the fragile rank listed
    swapped = x[0:1].clone()
    swapped[0, 150_000] = 3.0009  # the trainer ranks 150000 before 7 (within delta of the engine)
    rb = replay.rebuild_kept(swapped, [2], torch.from_numpy(got.extra), [0, 1], [got.fingerprint])
    assert rb.status.tolist() == [0] and rb.ids.tolist() == [7, 99_000, 120_000]
    s = sample(x[1], SamplingParams(temperature=1.0, top_k=3), 1, 0)
    assert encode_kept_record(s.ranked.numpy(), s.token_id, V, margins=s.margins.numpy(), tolerance=delta)[0] == 0x20
    greedy = sample(x[0], SamplingParams(temperature=0.0), 1, 0)
    assert encode_kept_record(greedy.ranked.numpy(), greedy.token_id, V, margins=greedy.margins.numpy(),
                              tolerance=delta) == b"\x23"  # the sampled token alone: one byte
    no_margins = sample(x[0], SamplingParams(temperature=1.0, top_k=2), 1, 0)  # a writer with ids only (vLLM's mask)
    assert encode_kept_record(no_margins.kept.numpy(), no_margins.token_id, V)[0] == 0x20
    assert encode_kept_record(no_margins.ranked.numpy(), no_margins.token_id, V, margins=no_margins.margins.numpy(),
                              tolerance=0.0)[0] == 0x20  # no tolerance stated: listed


def test_logits_beyond_the_tolerance_are_refused_never_taken_for_another_set():
    g = torch.Generator().manual_seed(8)
    V, delta = 3000, 1e-3
    x = torch.randn(200, V, generator=g) * 4
    recs = _record(x, SamplingParams(temperature=1.0, top_p=0.9), delta, 3)
    rows = [t for t, r in enumerate(recs) if isinstance(r[2], KeptToRebuild)]
    assert len(rows) > 100
    trainer = x + torch.randn(x.shape, generator=g) * 0.3  # other weights: far beyond delta
    rb = _rebuild(trainer, recs, 1.0, rows)
    ok = rb.status == replay.REBUILD_OK
    assert 0 < int((~ok).sum())
    for j, t in enumerate(rows):
        if ok[j]:  # a set that verifies is the recorded one
            assert np.array_equal(rb.ids[rb.offsets[j]:rb.offsets[j + 1]].numpy(), recs[t][1])


@pytest.mark.parametrize("blob, msg", [
    (b"\x24\x00\x00\x00\x00\x00", "kept top of 0 ids"),
    (b"\x24\x0b\x00\x00\x00\x00", "exceeds its bound 10"),
    (b"\x24\x02\x00\x00", "truncated"),
    (b"\x25\x0a\x01\x00\x00\x00\x00\x00", "exceeds its bound 9"),
    (b"\x25\x03\x08\x00" + b"\x00" * 11, "exceeds its bound 7"),  # 3 + 8 extras > 10 ids
    (b"\x25\x03\x00\x00\x00\x00\x00\x00", "empty kept extra"),
    (b"\x25\x03\x02\x08\x05\x00\x00\x00\x00", "outside the vocabulary"),
    (b"\x26", "unknown kept-set form 6"),
    (b"\x24\x02\x00\x00\x00\x00\x00", "trailing"),
])
def test_hostile_sets_to_rebuild_are_refused(blob, msg):
    with pytest.raises(ReplayFormatError, match=msg):
        decode_kept(blob, 10, token_id=1, tolerance=1e-3)
    ok = decode_kept(b"\x25\x03\x02\x01\x02\x01\x00\x00\x00", 10, tolerance=1e-3)
    assert (ok.top, ok.extra.tolist(), ok.fingerprint, ok.size) == (3, [1, 4], 1, 5)
