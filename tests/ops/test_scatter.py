"""``syncd.ops.scatter_words_``, the all-or-nothing scatter behind ``WeightUpdater.apply``/``rollback`` on CPU
parameters: its ``cpu`` and ``reference`` backends against each other, and the native kernel under the ``cpu``
backend (``syncd._native.scatter_runs_ptr``) against NumPy fancy indexing."""

from __future__ import annotations

import numpy as np
import pytest

from syncd.ops import _backend, scatter_words_

native = _backend.native()


def _runs(target: np.ndarray, idx: np.ndarray, before: np.ndarray, after: np.ndarray, sub: int):
    w = target.itemsize
    return [(target.ctypes.data, target.size, target.strides[0], idx.ctypes.data + 8 * lo,
             before.ctypes.data + w * lo, after.ctypes.data + w * lo, min(sub, idx.size - lo), w)
            for lo in range(0, idx.size, sub)]


@pytest.mark.parametrize("dtype", [np.uint8, np.int16, np.int32, np.int64])
@pytest.mark.parametrize("threads", [1, 2])
def test_scatter_equals_fancy_indexing(dtype, threads):
    rng = np.random.default_rng(0)
    t = rng.integers(0, 100, 50_000).astype(dtype)
    idx = np.sort(rng.choice(t.size, 3_000, replace=False)).astype(np.int64)
    old, new = t[idx].copy(), (t[idx] + 1).astype(dtype)
    want = t.copy()
    want[idx] = new
    assert native.scatter_runs_ptr(_runs(t, idx, old, new, 256), True, threads) == (-1, 0)
    assert np.array_equal(t, want)
    assert native.scatter_runs_ptr(_runs(t, idx, new, old, 256), False, threads) == (-1, 0)  # rollback
    assert np.array_equal(t[idx], old)


def test_strided_target_writes_only_its_words():
    """The bf16 halves of fp32 weights: a stride of 4 bytes for 2-byte words."""
    base = np.arange(1000, dtype=np.float32)
    halves = base.view(np.int16)[1::2]
    idx = np.array([0, 7, 999], dtype=np.int64)
    old = halves[idx].copy()
    new = (old + 1).astype(np.int16)
    lows = base.view(np.int16)[0::2].copy()
    assert native.scatter_runs_ptr(_runs(halves, idx, old, new, 2), True, 1) == (-1, 0)
    assert np.array_equal(halves[idx], new)
    assert np.array_equal(base.view(np.int16)[0::2], lows)  # the other halves untouched


@pytest.mark.parametrize("threads", [1, 2])
def test_mismatch_anywhere_leaves_every_target_unchanged(threads):
    rng = np.random.default_rng(1)
    a = rng.integers(0, 1000, 400_000).astype(np.int16)
    b = rng.integers(0, 1000, 400_000).astype(np.int16)
    ia = np.sort(rng.choice(a.size, 150_000, replace=False)).astype(np.int64)
    ib = np.sort(rng.choice(b.size, 150_000, replace=False)).astype(np.int64)
    oa, na = a[ia].copy(), (a[ia] + 3).astype(np.int16)
    ob, nb = b[ib].copy(), (b[ib] + 3).astype(np.int16)
    ob[100_000] += 1  # b's staged old word no longer matches: two of its words
    ob[100_010] += 1
    a0, b0 = a.copy(), b.copy()
    runs = _runs(a, ia, oa, na, 8192) + _runs(b, ib, ob, nb, 8192)
    failed, bad = native.scatter_runs_ptr(runs, True, threads)
    assert failed == len(_runs(a, ia, oa, na, 8192)) + 100_000 // 8192
    assert bad == 2
    assert np.array_equal(a, a0) and np.array_equal(b, b0)


def test_position_outside_the_target_fails_without_writing():
    t = np.zeros(100, dtype=np.int32)
    idx = np.array([3, 5, 100], dtype=np.int64)
    old = np.zeros(3, dtype=np.int32)
    new = np.ones(3, dtype=np.int32)
    assert native.scatter_runs_ptr(_runs(t, idx, old, new, 8), True, 1) == (0, -1)
    assert not t.any()


def test_bad_word_width_or_stride_is_refused():
    t = np.zeros(10, dtype=np.int16)
    idx = np.zeros(1, dtype=np.int64)
    run = (t.ctypes.data, t.size, 2, idx.ctypes.data, t.ctypes.data, t.ctypes.data, 1, 3)
    with pytest.raises(ValueError, match="width"):
        native.scatter_runs_ptr([run], True, 1)
    run = (t.ctypes.data, t.size, 1, idx.ctypes.data, t.ctypes.data, t.ctypes.data, 1, 2)
    with pytest.raises(ValueError, match="stride"):
        native.scatter_runs_ptr([run], True, 1)
    assert not t.any()


def _case(rng, n_items: int, dtype, *, bad_item=None, bad_words=0, outside=None):
    items, want = [], []
    for i in range(n_items):
        t = rng.integers(0, 1000, 20_000).astype(dtype)
        idx = np.sort(rng.choice(t.size, 2_500, replace=False)).astype(np.int64)
        old, new = t[idx].copy(), (t[idx] + 7).astype(dtype)
        if i == bad_item:
            old[rng.choice(idx.size, bad_words, replace=False)] += 1
        if i == outside:
            idx[-1] = t.size
        w = t.copy()
        w[idx[idx < t.size]] = new[idx < t.size]
        items.append((t, idx, old, new))
        want.append(w)
    return items, want


@pytest.mark.parametrize("dtype", [np.uint8, np.int16, np.int32, np.int64])
def test_the_public_op_writes_the_same_words_on_every_backend(dtype):
    for backend in ("cpu", "reference"):
        items, want = _case(np.random.default_rng(2), 3, dtype)
        assert scatter_words_(items, backend=backend) is None
        assert all(np.array_equal(t, w) for (t, *_), w in zip(items, want))
        undo = [(t, i, n, o) for t, i, o, n in items]
        assert scatter_words_(undo, verify=True, backend=backend) is None  # back to the old words


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("fault", ["mismatch", "outside"])
def test_the_public_op_writes_nothing_when_any_item_fails(backend, fault):
    kw = {"bad_item": 1, "bad_words": 3} if fault == "mismatch" else {"outside": 2}
    items, _ = _case(np.random.default_rng(3), 3, np.int16, **kw)
    before = [t.copy() for t, *_ in items]
    failed = scatter_words_(items, backend=backend)
    item, count = failed
    assert item == (1 if fault == "mismatch" else 2)
    assert (count >= 1) if fault == "mismatch" else (count == -1)
    assert all(np.array_equal(t, b) for (t, *_), b in zip(items, before))
    if fault == "mismatch":  # without verify the same words are written regardless
        assert scatter_words_(items, verify=False, backend=backend) is None


def test_the_public_op_refuses_mismatched_arrays():
    t = np.zeros(10, dtype=np.int16)
    with pytest.raises(ValueError, match="word width"):
        scatter_words_([(t, np.zeros(1, np.int64), np.zeros(1, np.int32), np.zeros(1, np.int16))])
    with pytest.raises(ValueError, match="int64"):
        scatter_words_([(t, np.zeros(1, np.int32), np.zeros(1, np.int16), np.zeros(1, np.int16))])
