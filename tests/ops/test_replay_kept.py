"""``syncd.ops.replay.kept_logprobs``: every backend against the reference and against the naive full-vocabulary
masked log-softmax; gradients against finite differences and PyTorch autograd through the reference; nothing
of size ``[T, V]`` is built but the gradient; the logits are not kept for the backward; bad input is refused
with the row named. Triton runs interpreted on the CPU."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from syncd.errors import BackendUnavailable
from syncd.ops import replay
from syncd.ops.reference import replay as ref
from tests.ops._util import on

BACKENDS = ["reference", "cpu", "triton"]
TOL = {torch.float32: 2e-6, torch.bfloat16: 2e-6, torch.float16: 2e-6}  # outputs are float32 in every case


def make_case(T: int, V: int, *, seed: int = 0, max_kept: int = 24, dtype=torch.float32, scale: float = 3.0):
    """Random logits and kept sets (ascending, 1..max_kept ids; row 0 keeps one id, row 1 the whole vocabulary)."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(T, V, generator=g) * scale).to(dtype)
    sets, targets = [], []
    for t in range(T):
        n = 1 if t == 0 else V if t == 1 else int(torch.randint(1, min(max_kept, V) + 1, (1,), generator=g))
        s = torch.randperm(V, generator=g)[:n].sort().values
        sets.append(s)
        targets.append(int(s[torch.randint(0, n, (1,), generator=g)]))
    sizes = torch.tensor([len(s) for s in sets])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)])
    return logits, torch.cat(sets), offsets, torch.tensor(targets)


def naive(logits, ids, offsets, targets, temperature=1.0):
    """The baseline: build the [T, V] mask, fill -inf, log_softmax, gather."""
    mask = torch.full(logits.shape, float("-inf"))
    mask[ref.kept_rows(offsets), ids] = 0.0
    return torch.log_softmax(logits.float() / temperature + mask, dim=1).gather(1, targets[:, None])[:, 0]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_backends_match_the_reference_and_the_naive_masked_softmax(backend, dtype, temperature):
    logits, ids, offsets, targets = make_case(40, 300, seed=3, dtype=dtype)
    w = torch.randn(40, generator=torch.Generator().manual_seed(1))
    want = ref.kept_logprobs(logits, ids, offsets, targets, temperature)[0]
    x = on(logits.clone(), backend).requires_grad_()
    got = replay.kept_logprobs(x, on(ids, backend), on(offsets, backend), on(targets, backend), temperature,
                               backend=backend)
    assert got.dtype == torch.float32 and got.shape == (40,)
    torch.testing.assert_close(got.detach().cpu(), want, atol=TOL[dtype], rtol=0)
    torch.testing.assert_close(got.detach().cpu(), naive(logits, ids, offsets, targets, temperature), atol=5e-6,
                               rtol=0)
    (got * on(w, backend)).sum().backward()
    assert x.grad.dtype == dtype
    xr = logits.clone().requires_grad_()
    (ref.kept_logprobs(xr, ids, offsets, targets, temperature)[0] * w).sum().backward()  # autograd of the spec
    torch.testing.assert_close(x.grad.cpu().float(), xr.grad.float(), atol=2e-6 if dtype == torch.float32 else 2e-2,
                               rtol=1e-2)
    xn = logits.clone().float().requires_grad_()
    (naive(xn, ids, offsets, targets, temperature) * w).sum().backward()
    if dtype == torch.float32:
        torch.testing.assert_close(x.grad.cpu(), xn.grad, atol=2e-6, rtol=1e-5)
    kept = torch.zeros(logits.shape, dtype=torch.bool)
    kept[ref.kept_rows(offsets), ids] = True
    assert not x.grad.cpu()[~kept].any()  # zero off the kept entries, exactly
    assert not x.grad.cpu()[0].any()  # a single kept token: probability 1, gradient 0


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_gradient_matches_finite_differences(backend):
    logits, ids, offsets, targets = make_case(6, 40, seed=5, max_kept=6, dtype=torch.float64)
    logits = logits.float()
    w = torch.tensor([0.3, -1.0, 0.7, 2.0, -0.5, 1.1])

    def f(x):
        return float((replay.kept_logprobs(on(x, backend), on(ids, backend), on(offsets, backend),
                                           on(targets, backend), 0.9, backend=backend).cpu().double() * w).sum())

    x = on(logits.clone(), backend).requires_grad_()
    (replay.kept_logprobs(x, on(ids, backend), on(offsets, backend), on(targets, backend), 0.9,
                          backend=backend) * on(w, backend)).sum().backward()
    rows = ref.kept_rows(offsets)
    eps = 1e-2
    for j in range(0, ids.numel(), 3):
        t, v = int(rows[j]), int(ids[j])
        up, down = logits.clone(), logits.clone()
        up[t, v] += eps
        down[t, v] -= eps
        fd = (f(up) - f(down)) / (2 * eps)
        assert abs(float(x.grad[t, v]) - fd) < 2e-3 * max(1.0, abs(fd)), (t, v, float(x.grad[t, v]), fd)


class _Sizes(TorchDispatchMode):
    """Records the number of elements of every new tensor an op produces (views of an input are not new)."""

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor) and a.layout == torch.strided}
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor) and o.is_sparse:
                self.sizes.append(o._nnz())  # what a sparse tensor holds
            elif isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in inputs:
                self.sizes.append(o.numel())
        return out


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_no_tensor_of_the_logits_size_but_the_gradient(backend):
    T, V = 64, 2000
    logits, ids, offsets, targets = make_case(T, V, seed=9)
    x = (logits.clone().requires_grad_() * 1.0)
    with _Sizes() as fwd:
        out = replay.kept_logprobs(x, ids, offsets, targets, backend=backend)
    assert max(fwd.sizes) < T * V // 8, "the forward built something the size of the logits"
    with _Sizes() as bwd:
        out.sum().backward()
    assert sum(s >= T * V // 8 for s in bwd.sizes) <= 2  # the gradient (and autograd's pass-through of it)
    assert max(bwd.sizes) == T * V


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_logits_are_not_kept_for_the_backward(backend):
    logits, ids, offsets, targets = make_case(8, 50, seed=2)
    leaf = on(logits.clone(), backend).requires_grad_()
    x = leaf * 2.0  # a non-leaf: only the op's saved tensors could keep it alive
    ref_x = weakref.ref(x)
    out = replay.kept_logprobs(x, on(ids, backend), on(offsets, backend), on(targets, backend), backend=backend)
    del x
    assert ref_x() is None
    out.sum().backward()
    assert leaf.grad is not None and leaf.grad.abs().sum() > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_is_refused_with_the_row_named(backend):
    logits, ids, offsets, targets = make_case(5, 30, seed=1, max_kept=4)

    def call(logits=logits, ids=ids, offsets=offsets, targets=targets, temperature=1.0):
        return replay.kept_logprobs(on(logits, backend), on(ids, backend), on(offsets, backend), on(targets, backend),
                                    temperature, backend=backend)

    outside = targets.clone()
    rows = ref.kept_rows(offsets)
    free = next(v for v in range(30) if v not in ids[rows == 3].tolist())
    outside[3] = free
    with pytest.raises(ValueError, match="target .* of row 3 is not in its kept set"):
        call(targets=outside)
    empty = offsets.clone()
    empty[2] = empty[1]  # row 1 loses its ids to row 2
    with pytest.raises(ValueError, match="row 1 has 0 kept ids"):
        call(offsets=empty)
    unsorted = ids.clone()
    lo, hi = int(offsets[1]), int(offsets[2])
    unsorted[lo:hi] = unsorted[lo:hi].flip(0)
    with pytest.raises(ValueError, match="row 1 are not strictly ascending"):
        call(ids=unsorted)
    with pytest.raises(ValueError, match="kept ids outside 0..29"):
        call(ids=torch.where(ids == ids.max(), 30, ids))
    with pytest.raises(ValueError, match="6 offsets and 5 targets"):
        call(offsets=offsets[:-1])
    with pytest.raises(ValueError, match="temperature"):
        call(temperature=0.0)
    with pytest.raises(ValueError, match="logits must be"):
        call(logits=logits[None])
    with pytest.raises(ValueError, match="integer"):
        call(ids=ids.float())


def test_unavailable_backends_say_why():
    logits, ids, offsets, targets = make_case(3, 10)
    with pytest.raises(BackendUnavailable, match="cuda"):
        replay.kept_logprobs(logits, ids, offsets, targets, backend="cuda")
    with pytest.raises(BackendUnavailable, match="unknown backend"):
        replay.kept_logprobs(logits, ids, offsets, targets, backend="fast")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_sparse_gradient_flows_through_the_lm_head_without_any_dense_logits_gradient(backend):
    T, V, H = 32, 500, 16
    logits0, ids, offsets, targets = make_case(T, V, seed=4)
    g = torch.Generator().manual_seed(6)
    hidden, weight = torch.randn(T, H, generator=g), torch.randn(V, H, generator=g) * 0.3
    w = torch.randn(T, generator=g)
    grads = {}
    for sparse in (False, True):
        h = on(hidden.clone(), backend).requires_grad_()
        W = on(weight.clone(), backend).requires_grad_()
        logits = torch.nn.functional.linear(h, W)
        out = replay.kept_logprobs(logits, on(ids, backend), on(offsets, backend), on(targets, backend), 0.8,
                                   backend=backend, sparse_grad=sparse)
        with _Sizes() as bwd:
            (out * on(w, backend)).sum().backward()
        grads[sparse] = (h.grad.cpu(), W.grad.cpu(), max(bwd.sizes))
        assert h.grad.layout == W.grad.layout == torch.strided
    (hd, wd, biggest_dense), (hs, ws, biggest_sparse) = grads[False], grads[True]
    torch.testing.assert_close(hs, hd, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ws, wd, atol=1e-5, rtol=1e-5)
    assert biggest_dense == T * V and biggest_sparse < T * V  # nothing of the logits' size in the backward
    x = logits0.clone().requires_grad_()
    replay.kept_logprobs(x, ids, offsets, targets, sparse_grad=True).sum().backward()
    assert x.grad.is_sparse and x.grad._nnz() == ids.numel()
    xd = logits0.clone().requires_grad_()
    replay.kept_logprobs(xd, ids, offsets, targets).sum().backward()
    torch.testing.assert_close(x.grad.to_dense(), xd.grad, atol=1e-7, rtol=0)
