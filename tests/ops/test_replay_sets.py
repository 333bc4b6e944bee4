"""``syncd.ops.replay.kept_sets`` / ``kept_fingerprint`` / ``rebuild_kept``: the vectorised implementation against the
per-row specification (the sampler's own algorithm) on ties, near-ties, every dtype and per-row parameters;
fingerprints against the pure-Python reference; rebuilding verified, and refused where it is not the set."""

from __future__ import annotations

import pytest
import torch

from syncd.errors import BackendUnavailable
from syncd.ops import replay
from syncd.ops._dispatch import backends_of
from syncd.ops.reference import replay as ref


def _logits(T: int, V: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, V, generator=g) * 3
    x[0] = 0.0  # every id tied
    x[1, 5:15] = float(x[1].max()) + 1  # ten tied at the top
    x[2] = torch.randint(0, 4, (V,), generator=g).float()  # ties everywhere, across any topk edge
    x[3] = torch.round(x[3] * 2) / 2  # coarse: many ties
    return x.to(dtype)


def _rows(ks, t):
    a, b = int(ks.offsets[t]), int(ks.offsets[t + 1])
    return ks.ids[a:b], ks.values[a:b], ks.gaps[a:b], ks.logprobs[a:b]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("params", [(1.0, 0, 0.8), (1.0, 20, 0.8), (0.7, 5, 1.0), (1.0, 0, 1.0), (0.0, 0, 0.3),
                                    (1.3, 50, 0.95), "per-row"])
def test_kept_sets_match_the_per_row_specification(dtype, params):
    T, V = 40, 300
    x = _logits(T, V, 1, dtype)
    if params == "per-row":
        g = torch.Generator().manual_seed(2)
        params = (torch.rand(T, generator=g) + 0.2, torch.randint(0, 30, (T,), generator=g),
                  torch.rand(T, generator=g) * 0.9 + 0.1)
        params[0][::7] = 0.0  # some greedy rows
    temp, top_k, top_p = params
    got = replay.kept_sets(x, temp, top_k, top_p)
    want = replay.kept_sets(x, temp, top_k, top_p, backend="reference")
    for t in range(T):
        temp_t, k_t, p_t = (v[t].item() if torch.is_tensor(v) else v for v in params)
        spec = ref.kept_set_row(x[t], temp_t, k_t, p_t)
        for a, b, c in zip(_rows(got, t), _rows(want, t), spec):
            assert torch.equal(b, c)
            assert torch.equal(a, c) if a.dtype == torch.int64 else torch.allclose(a, c, atol=2e-6, rtol=0)
        ids, vals, gaps, lp = _rows(got, t)
        assert torch.equal(vals[:-1] - vals[1:], gaps[:-1])  # gaps to the next rank
        assert bool((gaps >= 0).all()) and torch.allclose(lp.exp().sum(), torch.tensor(1.0), atol=1e-5)
        if temp_t == 0:
            assert ids.numel() == 1 and int(ids[0]) == int(torch.argmax(x[t].float())) and float(lp[0]) == 0.0
    one = replay.kept_sets(x[7:8], *(v[7:8] if torch.is_tensor(v) else v for v in params))
    for a, b in zip(_rows(one, 0), ref.kept_set_row(x[7], *(v[7].item() if torch.is_tensor(v) else v for v in params))):
        assert torch.equal(a, b)  # one row (the engine's call) is the specification bit for bit


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("params", [(1.0, 20, 0.8), (1.0, 0, 0.8), (0.7, 5, 1.0), (0.0, 0, 0.3), (1.3, 299, 0.95),
                                    (1.0, 20, 1 - 1e-9), (1.0, 1, 0.5)])
@pytest.mark.parametrize("V", [2, 300])
def test_rows_sharing_scalar_parameters_get_the_general_paths_bits(dtype, params, V):
    """Scalar parameters take the sampler's few-op path (``_uniform``); the same parameters given one per row take
    the general one: every field must be equal bit for bit, logprobs and gaps included."""
    x = _logits(24, V, 5, dtype) if V > 2 else torch.tensor([[1.0, 1.0], [0.5, -0.5], [-1.0, 2.0]], dtype=dtype)
    T = x.shape[0]
    temp, top_k, top_p = params
    fast = replay.kept_sets(x, temp, top_k, top_p)
    general = replay.kept_sets(x, torch.full((T,), temp), torch.full((T,), top_k), torch.full((T,), top_p))
    for f in fast._fields:
        assert torch.equal(getattr(fast, f), getattr(general, f)), f


@pytest.mark.parametrize("V", [2, 17, 300, 5000])
def test_sizes_keep_the_first_ranks_exactly_as_the_sampler_ranks(V):
    x = _logits(12, V, 3)
    g = torch.Generator().manual_seed(4)
    sizes = torch.randint(1, V + 1, (12,), generator=g)
    sizes[:4] = torch.tensor([1, min(3, V), V, max(1, V - 1)])
    got = replay.kept_sets(x, 0.9, sizes=sizes)
    want = replay.kept_sets(x, 0.9, sizes=sizes, backend="reference")
    assert all(torch.equal(getattr(got, f), getattr(want, f)) for f in ("offsets", "ids", "gaps"))
    full = replay.kept_sets(x, 0.9)  # the whole vocabulary, ranked
    for t in range(12):
        assert torch.equal(_rows(got, t)[0], _rows(full, t)[0][:int(sizes[t])])


def test_fingerprints_match_the_reference_and_a_changed_id_always_changes_them():
    g = torch.Generator().manual_seed(5)
    sizes = torch.randint(1, 50, (300,), generator=g)
    ids = torch.randint(0, 1 << 26, (int(sizes.sum()),), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)])
    fp = replay.kept_fingerprint(ids, offsets)
    assert fp.dtype == torch.int64 and int(fp.min()) >= 0 and int(fp.max()) < 1 << 32
    for t in range(300):
        row = ids[offsets[t]:offsets[t + 1]]
        assert int(fp[t]) == ref.kept_fingerprint(row.tolist())
        assert int(replay.kept_fingerprint(row.flip(0), torch.tensor([0, row.numel()]))[0]) == int(fp[t])  # any order
    swapped = ids.clone()
    swapped[offsets[:-1]] = (swapped[offsets[:-1]] + 1 + torch.randint(0, 1000, (300,), generator=g)) % (1 << 26)
    assert bool((replay.kept_fingerprint(swapped, offsets) != fp).all())  # lowbias32 is a bijection
    assert ref.kept_fingerprint([]) == 0 and ref.kept_fingerprint([0]) != 0


def _record(ks, tops):
    """Recorded sets: the first ``tops[t]`` ranks, the rest of each set listed as extras."""
    ids, offsets = ks.ids, ks.offsets
    extras, sizes = [], []
    for t in range(offsets.numel() - 1):
        row = ids[offsets[t]:offsets[t + 1]]
        extras.append(row[tops[t]:].sort().values)
        sizes.append(row.numel() - tops[t])
    return (torch.cat(extras), torch.cat([torch.zeros(1, dtype=torch.int64), torch.tensor(sizes).cumsum(0)]),
            replay.kept_fingerprint(ids, offsets))


def test_rebuild_is_verified_and_refused_where_the_logits_rank_otherwise():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(30, 500, generator=g) * 2
    ks = replay.kept_sets(x, 1.0, 0, 0.8)
    sizes = (ks.offsets[1:] - ks.offsets[:-1]).tolist()
    tops = [max(1, s - (t % 3)) for t, s in enumerate(sizes)]
    extra, extra_off, fp = _record(ks, tops)
    rb = replay.rebuild_kept(x, torch.tensor(tops), extra, extra_off, fp)
    assert bool((rb.status == replay.REBUILD_OK).all())
    for t in range(30):
        assert torch.equal(rb.ids[rb.offsets[t]:rb.offsets[t + 1]], _rows(ks, t)[0].sort().values)
    assert torch.allclose(rb.margin, torch.stack([_rows(ks, t)[2][tops[t] - 1] for t in range(30)]))
    y = x.clone()
    y[0, _rows(ks, 0)[0][0]] = -100.0  # row 0's best id falls out of the top: another set
    y[1] = torch.randn(500, generator=g)  # row 1: other logits altogether
    bad = replay.rebuild_kept(y, torch.tensor(tops), extra, extra_off, fp)
    assert bad.status[0] != replay.REBUILD_OK and bad.status[1] != replay.REBUILD_OK
    assert bool((bad.status[2:] == replay.REBUILD_OK).all())
    j = next(t for t in range(30) if tops[t] < sizes[t])  # a row with extras: an extra id ranked into the top
    z = x.clone()
    z[j, extra[extra_off[j]]] = 100.0
    assert replay.rebuild_kept(z, torch.tensor(tops), extra, extra_off, fp).status[j] == replay.REBUILD_OVERLAP


def test_bad_arguments_and_backends_are_refused():
    x = torch.randn(3, 10)
    with pytest.raises(ValueError, match="top_p"):
        replay.kept_sets(x, 1.0, 0, 0.0)
    with pytest.raises(ValueError, match="temperatures"):
        replay.kept_sets(x, -1.0)
    with pytest.raises(ValueError, match="one per row"):
        replay.kept_sets(x, torch.ones(2))
    with pytest.raises(ValueError, match="sizes must be in 1..10"):
        replay.kept_sets(x, sizes=torch.tensor([1, 11, 2]))
    with pytest.raises(ValueError, match=r"\[T, V\]"):
        replay.kept_sets(torch.randn(10))
    with pytest.raises(ValueError, match="extra ids outside"):
        replay.rebuild_kept(x, [1, 1, 1], [10], [0, 1, 1, 1], [0, 0, 0])
    with pytest.raises(ValueError, match="tops must be in"):
        replay.rebuild_kept(x, [0, 1, 1], [], [0, 0, 0, 0], [0, 0, 0])
    with pytest.raises(ValueError, match="extra offsets"):
        replay.rebuild_kept(x, [1, 1, 1], [1], [0, 2, 1, 1], [0, 0, 0])
    with pytest.raises(BackendUnavailable, match="works on CUDA tensors"):
        replay.kept_sets(x, backend="cuda")  # the device's own reason, from the dispatch table
    with pytest.raises(BackendUnavailable, match="unknown backend"):
        replay.kept_sets(x, backend="fast")
    assert set(backends_of("kept_sets")) == {"reference", "cpu", "cuda", "triton"}
    a, b = replay.kept_sets(x, 0.8, 3, 0.9), replay.kept_sets(x, 0.8, 3, 0.9, backend="cpu")  # auto takes cpu
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    empty = replay.kept_sets(torch.zeros(0, 10))
    assert empty.ids.numel() == 0 and empty.offsets.tolist() == [0]
