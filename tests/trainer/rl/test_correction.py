"""``syncd.trainer.rl.correction``: truncated IS, band masking, geometric sequence rejection, ESS, raw (pre-clip) ratio
statistics, per-token versions and the by-source split, on hand-checked numbers."""

from __future__ import annotations

import math

import pytest
import torch

from syncd.trainer.rl import correction as C


def test_raw_statistics_are_those_before_any_clip_or_mask():
    lq = torch.log(torch.tensor([0.5, 0.5, 0.5, 0.5, 0.1]))
    lp = torch.log(torch.tensor([0.5, 0.525, 0.4, 0.5, 1.0]))  # ratios 1, 1.05, 0.8, 1, 10
    out = C.correct(lp, lq, cap=2.0, band=(0.5, 5.0))
    r = torch.tensor([1.0, 1.05, 0.8, 1.0, 10.0], dtype=torch.float64)
    assert out.raw.tokens == 5 and out.raw.max == pytest.approx(10.0) and out.raw.mean == pytest.approx(float(r.mean()))
    assert out.raw.outside == pytest.approx(2 / 5)  # 0.8 and 10
    assert out.raw.max_abs_log_ratio == pytest.approx(math.log(10))
    assert out.raw.kl_k1 == pytest.approx(float(-torch.log(r).mean()))
    assert out.raw.kl_k3 == pytest.approx(float((r - 1 - torch.log(r)).mean())) and out.raw.kl_k3 > 0
    assert out.band_masked == 1 and out.capped == 0  # 10 is outside the band, so never capped
    assert out.keep.tolist() == [True, True, True, True, False]
    torch.testing.assert_close(out.weights, torch.tensor([1.0, 1.05, 0.8, 1.0, 0.0]))
    assert out.kept.max == pytest.approx(1.05)
    s = out.summary()
    assert s["raw/max"] == pytest.approx(10.0) and s["kept/max"] == pytest.approx(1.05) and s["band_masked"] == 1


def test_truncated_is_caps_and_counts():
    lq = torch.zeros(4)
    lp = torch.log(torch.tensor([0.5, 1.0, 3.0, 7.0]))
    out = C.correct(lp, lq, cap=2.0)
    torch.testing.assert_close(out.weights, torch.tensor([0.5, 1.0, 2.0, 2.0]))
    assert out.capped == 2 and out.raw.max == pytest.approx(7.0)
    torch.testing.assert_close(C.truncated_is(torch.log(torch.tensor([3.0, 0.2])), 2.0), torch.tensor([2.0, 0.2]))
    uncapped = C.correct(lp, lq, cap=None)
    torch.testing.assert_close(uncapped.weights, torch.tensor([0.5, 1.0, 3.0, 7.0]))


def test_geometric_sequence_rejection_rejects_whole_sequences():
    lq = torch.zeros(3, 4)
    lp = torch.log(torch.tensor([[1.0, 1.0, 1.0, 1.0],
                                 [4.0, 4.0, 0.25, 4.0],     # geometric mean 2 (one low token cannot save it)
                                 [0.5, 2.0, 1.0, 1.0]]))    # geometric mean 1
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[2, 3] = False
    out = C.correct(lp, lq, mask, cap=None, seq_band=(0.8, 1.25))
    assert out.rejected_sequences == 1 and out.rejected_tokens == 4
    assert out.keep.tolist() == [[True] * 4, [False] * 4, [True, True, True, False]]
    flat = C.sequence_rejection((lp - lq).reshape(-1), mask.reshape(-1), 0.8, 1.25,
                                seq_ids=torch.arange(3).repeat_interleave(4))
    assert flat.tolist() == C.sequence_rejection(lp - lq, mask, 0.8, 1.25).reshape(-1).tolist()
    with pytest.raises(ValueError, match="seq_ids"):
        C.sequence_rejection((lp - lq).reshape(-1), mask.reshape(-1), 0.8, 1.25)


def test_effective_sample_size():
    assert C.effective_sample_size(torch.ones(10)) == pytest.approx(1.0)
    w = torch.tensor([100.0] + [1e-3] * 9)
    assert C.effective_sample_size(w) == pytest.approx(0.1, rel=1e-3)
    assert C.effective_sample_size(torch.zeros(3)) == 0.0
    assert math.isnan(C.effective_sample_size(torch.ones(3), torch.zeros(3, dtype=torch.bool)))
    out = C.correct(torch.log(torch.tensor([1.0, 1.0, 4.0])), torch.zeros(3), cap=None)
    assert out.ess == pytest.approx(36 / (3 * 18))


def test_band_mask_and_bad_input():
    lr = torch.log(torch.tensor([0.5, 0.9, 1.0, 1.2, 3.0]))
    assert C.band_mask(lr, 0.8, 1.25).tolist() == [False, True, True, True, False]
    with pytest.raises(ValueError, match="band must hold 1"):
        C.band_mask(lr, 1.1, 2.0)
    with pytest.raises(ValueError, match="differ in shape"):
        C.correct(torch.zeros(3), torch.zeros(4))
    with pytest.raises(ValueError, match="not finite"):
        C.correct(torch.tensor([0.0, -math.inf]), torch.zeros(2))
    C.correct(torch.tensor([0.0, -math.inf]), torch.zeros(2), torch.tensor([True, False]))  # masked out: fine


def test_tokens_use_their_own_versions_log_prob():
    versions = torch.tensor([3, 3, 4, 4, 5, -1])  # an update after token 1 and after token 3; -1: prompt
    mask = versions >= 0
    by_version = {3: torch.full((6,), -1.0), 4: torch.full((6,), -2.0), 5: torch.full((6,), -3.0)}
    got = C.select_by_version(by_version, versions, mask)
    assert got[:5].tolist() == [-1.0, -1.0, -2.0, -2.0, -3.0]
    with pytest.raises(KeyError, match=r"version\(s\) \[5\]"):
        C.select_by_version({3: by_version[3], 4: by_version[4]}, versions, mask)
    lag = C.staleness(versions, 6, mask)
    assert lag == {"tokens": 5, "mean": pytest.approx(2.2), "max": 3, "min": 1, "counts": {1: 1, 2: 2, 3: 2}}
    with pytest.raises(ValueError, match="newer"):
        C.staleness(versions, 4, mask)


def test_mismatch_by_source_adds_up():
    g = torch.Generator().manual_seed(0)
    engine = -torch.rand(50, generator=g) * 3
    replayed = engine + 1e-6 * torch.randn(50, generator=g)
    own_routing = replayed + 0.01 * torch.randn(50, generator=g)
    full = own_routing + torch.log(torch.rand(50, generator=g) * 0.5 + 0.3)  # log kept mass < 0
    current = full + 0.05 * torch.randn(50, generator=g)
    split = C.mismatch_by_source(engine, replayed, own_routing=own_routing, full_vocab=full, current=current,
                                 routing_disagreement=0.1, versions=torch.full((50,), 2), current_version=3)
    parts = split.components
    assert list(parts) == ["numerics", "routing", "kept_set", "staleness"]
    assert sum(p["mean"] for p in parts.values()) == pytest.approx(split.total["mean"], abs=1e-9)
    assert parts["kept_set"]["mean"] < 0 and parts["numerics"]["max_abs"] < 1e-5
    assert split.lag["mean"] == 1 and split.routing_disagreement == 0.1
    merged = C.mismatch_by_source(engine, replayed, full_vocab=full)  # dense: routing merges into kept_set
    assert list(merged.components) == ["numerics", "kept_set"]
    assert merged.components["kept_set"]["mean"] == pytest.approx(float((full - replayed).double().mean()))
