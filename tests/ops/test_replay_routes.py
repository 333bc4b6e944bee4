"""``syncd.ops.replay`` route ops: packing at ``ceil(log2 E)`` bits and unpacking, reference and Triton bit for bit
(and the same bytes as the replay format's routing payload); the routed gather and its backward bit for bit,
``NO_ROUTE`` never read as expert 0; hostile input refused. Triton runs interpreted on the CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from syncd.errors import BackendUnavailable
from syncd.ops import replay
from tests.ops._util import on

EXPERTS = [1, 2, 3, 8, 60, 128, 255, 256, 1000, 65536]


def _ids(n: int, E: int, seed: int) -> torch.Tensor:
    return torch.randint(0, E, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("E", EXPERTS)
def test_pack_and_unpack_agree_bit_for_bit_across_backends(E):
    b = replay.bits_per_id(E)
    assert b == max(1, int(np.ceil(np.log2(E))))
    for n in (0, 1, 7, 8, 9, 333, 4097):
        ids = _ids(n, E, seed=n + E)
        ref = replay.pack_routes(ids.view(-1, 1) if n else ids, E, backend="reference")
        assert ref.dtype == torch.uint8 and ref.numel() == (n * b + 7) // 8
        tri = replay.pack_routes(on(ids, "triton"), E, backend="triton").cpu()
        assert torch.equal(ref, tri)
        for backend in ("reference", "triton"):
            got = replay.unpack_routes(on(ref, backend), n, E, backend=backend).cpu()
            assert torch.equal(got, ids)
        # LSB-first b-bit fields, row-major: the layout docs/replay-format.md specifies
        bits = np.unpackbits(ref.numpy(), bitorder="little")[: n * b].reshape(n, b) if n else np.zeros((0, b))
        assert np.array_equal(bits @ (1 << np.arange(b)), ids.numpy())


def test_the_format_routing_payload_is_these_bytes():
    from syncd.records import replay as fmt

    ids = torch.randint(0, 60, (5, 3, 4), generator=torch.Generator().manual_seed(1))
    blob = fmt.pack_routing(ids.numpy(), 60)
    payload = replay.pack_routes(ids, 60).numpy().tobytes()
    assert blob.endswith(payload) and len(blob) - len(payload) == 5  # tag + 4 one-byte varints


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_hostile_packed_routes_are_refused(backend):
    packed = replay.pack_routes(torch.tensor([5, 1, 2]), 6)  # 3 bits each: 9 bits in 2 bytes
    bad_pad = packed.clone()
    bad_pad[-1] |= 0x80
    with pytest.raises(ValueError, match="padding bits"):
        replay.unpack_routes(on(bad_pad, backend), 3, 6, backend=backend)
    seven = replay.pack_routes(torch.tensor([7, 0, 0]), 8)  # a 3-bit field holding 7 >= 6
    with pytest.raises(ValueError, match="expert id 7 outside 0..5"):
        replay.unpack_routes(on(seven, backend), 3, 6, backend=backend)
    with pytest.raises(ValueError, match="take 2 bytes"):
        replay.unpack_routes(on(packed[:1], backend), 3, 6, backend=backend)
    with pytest.raises(ValueError, match="outside 0..5"):
        replay.pack_routes(on(torch.tensor([6]), backend), 6, backend=backend)
    with pytest.raises(ValueError, match="outside 0..5"):
        replay.pack_routes(on(torch.tensor([-1]), backend), 6, backend=backend)
    with pytest.raises(ValueError, match="num_experts"):
        replay.pack_routes(torch.tensor([0]), 0)


def _routes(N: int, E: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    r = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    r[::7] = replay.NO_ROUTE  # padding positions
    return r


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_routed_gather_and_its_backward_are_bit_exact_across_backends(dtype):
    N, E, k = 300, 16, 4
    probs = torch.softmax(torch.randn(N, E, generator=torch.Generator().manual_seed(2)), -1).to(dtype)
    routes = _routes(N, E, k, 3).to(replay.route_dtype(E))
    grad = torch.randn(N, k, generator=torch.Generator().manual_seed(4)).to(dtype)
    outs = {}
    for backend in ("reference", "triton"):
        p = on(probs.clone(), backend).requires_grad_()
        w = replay.gather_routed(p, on(routes, backend), backend=backend)
        w.backward(on(grad, backend))
        outs[backend] = (w.detach().cpu(), p.grad.cpu())
    (w_ref, g_ref), (w_tri, g_tri) = outs["reference"], outs["triton"]
    assert torch.equal(w_ref.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       w_tri.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
    assert torch.equal(g_ref, g_tri)
    valid = routes >= 0
    idx = routes.clamp(min=0).long()
    assert torch.equal(w_ref[valid], probs.gather(1, idx)[valid]) and not w_ref[~valid].any()
    assert not g_ref[::7].any(), "a padding position (NO_ROUTE) was read as an expert"
    assert torch.equal(g_ref.gather(1, idx)[valid], grad[valid])
    assert int((g_ref != 0).sum()) <= int(valid.sum())  # nothing but the routed entries


def test_routed_gather_refuses_bad_routes():
    probs = torch.rand(3, 4)
    with pytest.raises(ValueError, match="twice"):
        replay.gather_routed(probs, torch.tensor([[1, 1], [0, 2], [3, 2]]))
    with pytest.raises(ValueError, match="outside -1..3"):
        replay.gather_routed(probs, torch.tensor([[1, 4], [0, 2], [3, 2]]))
    with pytest.raises(ValueError, match="outside -1..3"):
        replay.gather_routed(probs, torch.tensor([[1, -2], [0, 2], [3, 2]]))
    with pytest.raises(ValueError, match="N = 3"):
        replay.gather_routed(probs, torch.tensor([[1, 2]]))
    with pytest.raises(BackendUnavailable, match="no cpu kernel"):
        replay.gather_routed(probs, torch.tensor([[1, 2], [0, 2], [3, 2]]), backend="cpu")
    assert replay.gather_routed(probs, torch.full((3, 2), -1)).abs().sum() == 0  # all padding: weights 0


def test_route_dtype_is_compact_and_holds_no_route():
    assert replay.route_dtype(8) == torch.int8 and replay.route_dtype(127) == torch.int8
    assert replay.route_dtype(128) == torch.int16 and replay.route_dtype(32768) == torch.int32
    with pytest.raises(ValueError):
        replay.route_dtype(0)
