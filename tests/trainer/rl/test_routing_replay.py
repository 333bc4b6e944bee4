"""``syncd.trainer.rl.replay.routing_replay`` on transformers' Qwen3-MoE and Mixtral (tiny, random init): replaying a
model's own routes reproduces it bit for bit (outputs and every gradient); recorded routes are what the experts run;
the router keeps its gradient (checked against finite differences); activation checkpointing recomputes with
the same routes, inside the context and after it; padding is never taken for expert 0; bad routes and misuse
raise named errors."""

from __future__ import annotations

import pytest
import torch

from syncd.engine.reference.make_tiny import model_config, random_model
from syncd.ops.replay import NO_ROUTE
from syncd.trainer.rl.replay import RoutingReplayError, moe_routers, routing_replay

ARCHS = ["qwen3_moe", "mixtral"]
IMPLS = ["grouped_mm", "batched_mm", "eager"]  # transformers' experts implementations (grouped_mm: the default)


def tiny(arch: str, dtype=torch.float32, seed: int = 0, experts_impl: str | None = None):
    cfg = model_config(arch, hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64, experts=8, top_k=2)
    model = random_model(cfg, seed).to(dtype)
    if experts_impl is not None:
        model.set_experts_implementation(experts_impl)
    with torch.no_grad():  # spread the router logits so top-k choices are clear-cut
        for r in moe_routers(model):
            r.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(seed + 1))
    return model


def own_routes(model, ids: torch.Tensor) -> torch.Tensor:
    """[B, T, L, k] experts the model's routers choose for ``ids`` (captured by hooks)."""
    got = []
    hooks = [r.register_forward_hook(lambda m, a, out: got.append(out[2].detach())) for r in moe_routers(model)]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    B, T = ids.shape
    return torch.stack(got, dim=1).view(B, T, len(got), -1)


def ids_for(model, B=2, T=9, seed=0):
    return torch.randint(0, model.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


def routed(arch: str, *, B=2, T=9, **kw):
    """``(model, ids, routes)``: a :func:`tiny` model (``kw``), token ids for it and the routes it chooses for them."""
    model = tiny(arch, **kw)
    ids = ids_for(model, B=B, T=T)
    return model, ids, own_routes(model, ids)


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def loss_of(model, ids):
    logits = model(ids).logits
    return (logits if logits.dtype == torch.float64 else logits.float()).pow(2).mean()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("impl", IMPLS)
def test_replaying_the_models_own_routes_is_bit_identical(arch, impl):
    model, ids, routes = routed(arch, experts_impl=impl)
    ref_logits = model(ids).logits
    ref_logits.float().pow(2).mean().backward()
    ref_grads = grads(model)
    model.zero_grad()
    with routing_replay(model, routes.to(torch.int8)) as rr:
        logits = model(ids).logits
        logits.float().pow(2).mean().backward()
    assert torch.equal(logits, ref_logits)
    got = grads(model)
    assert got.keys() == ref_grads.keys()
    # batched_mm accumulates the experts' weight gradients in a run-to-run varying order (two plain runs differ
    # too): those are compared closely, everything else bit for bit
    loose = {n for n in got if impl == "batched_mm" and ".experts." in n}
    assert all(torch.equal(got[n], ref_grads[n]) for n in got if n not in loose), \
        [n for n in got if n not in loose and not torch.equal(got[n], ref_grads[n])]
    assert all(torch.allclose(got[n], ref_grads[n], rtol=1e-5, atol=1e-7) for n in loose)
    assert any("gate" in n and got[n].abs().sum() > 0 for n in got), "the router lost its gradient"
    assert rr.disagreement == 0.0 and rr.routed_pairs == ids.numel() * len(moe_routers(model))
    assert not any(hasattr(r, "_syncd_routing_replay") or "forward" in vars(r) for r in moe_routers(model))


@pytest.mark.parametrize("arch", ARCHS)
def test_the_experts_run_the_recorded_routes_and_disagreement_is_counted(arch):
    model, ids, own = routed(arch)
    recorded = own.clone()
    recorded[0, :4, 0] = (own[0, :4, 0] + 3) % 8  # another expert set at 4 positions of layer 0
    clash = recorded[0, :4, 0, 0] == recorded[0, :4, 0, 1]
    recorded[0, :4, 0, 0] = torch.where(clash, (recorded[0, :4, 0, 0] + 1) % 8, recorded[0, :4, 0, 0])
    seen = []
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    hooks = [e.register_forward_pre_hook(lambda m, a: seen.append(a[1].clone())) for e in experts]
    with routing_replay(model, recorded) as rr:
        with torch.no_grad():
            replayed = model(ids).logits
    for h in hooks:
        h.remove()
    for layer, idx in enumerate(seen):
        assert torch.equal(idx.view(2, 9, 2), recorded[:, :, layer])
    changed = (own[:, :, 0].sort(-1).values != recorded[:, :, 0].sort(-1).values).any(-1).sum()
    assert rr.disagreement_by_layer[0] == pytest.approx(int(changed) / 18) and rr.disagreement_by_layer[1] == 0
    assert not torch.equal(replayed, model(ids).logits)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_router_gradient_matches_finite_differences(arch):
    model, ids, routes = routed(arch, B=1, T=6, dtype=torch.float64, experts_impl="eager")  # (no float64 grouped_mm)
    routes[0, 2, 1] = (routes[0, 2, 1] + 5) % 8  # not the model's own choice: the gradient still flows
    routes[0, 2, 1, 0] = torch.where(routes[0, 2, 1, 0] == routes[0, 2, 1, 1], (routes[0, 2, 1, 1] + 1) % 8,
                                     routes[0, 2, 1, 0])
    w = torch.randn(1, 6, model.config.vocab_size, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    def loss():
        return (model(ids).logits * w).sum()

    router = moe_routers(model)[1]
    with routing_replay(model, routes):
        loss().backward()
        g = router.weight.grad.clone()
        assert g.abs().sum() > 0
        # the routers' softmax runs in float32 (the models' own formula): a wide step keeps its rounding small
        eps = 1e-2
        for flat in g.abs().reshape(-1).topk(4).indices.tolist():
            e, h = divmod(flat, g.shape[1])
            with torch.no_grad():
                router.weight[e, h] += eps
                up = float(loss())
                router.weight[e, h] -= 2 * eps
                down = float(loss())
                router.weight[e, h] += eps
            fd = (up - down) / (2 * eps)
            assert abs(float(g[e, h]) - fd) < 1e-2 * abs(fd), (e, h, float(g[e, h]), fd)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("where", ["inside", "after-exit", "reentrant-inside"])
def test_activation_checkpointing_recomputes_with_the_same_routes(arch, where):
    model, ids, routes = routed(arch)
    model.train()
    g = torch.Generator().manual_seed(5)
    routes = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(routes[..., 0].numel())]).view_as(routes)
    with routing_replay(model, routes):
        loss_of(model, ids).backward()
    want = grads(model)
    model.zero_grad()
    # transformers >= 5.20 names it activation_checkpointing_enable; 5.19 (vLLM's pin) gradient_checkpointing_enable
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable({"use_reentrant": where == "reentrant-inside"})
    recomputes = []
    hooks = [r.register_forward_hook(lambda m, a, o: recomputes.append(torch._C._current_graph_task_id() != -1))
             for r in moe_routers(model)]
    if where == "after-exit":
        with routing_replay(model, routes):
            loss = loss_of(model, ids)
        assert hasattr(moe_routers(model)[0], "_syncd_routing_replay")  # lingers for the recompute
        with torch.no_grad():  # an unrelated forward meanwhile runs the model's own routing
            assert torch.equal(model(ids).logits, model(ids).logits)
        loss.backward()
        del loss
    else:
        with routing_replay(model, routes):
            loss_of(model, ids).backward()
    for h in hooks:
        h.remove()
    assert any(recomputes), "no recompute happened: checkpointing is not exercised"
    got = grads(model)
    assert all(torch.allclose(got[n], want[n], atol=1e-6, rtol=1e-5) for n in want), \
        [n for n in want if not torch.allclose(got[n], want[n], atol=1e-6, rtol=1e-5)]
    assert not any(hasattr(r, "_syncd_routing_replay") for r in moe_routers(model)), "replay did not uninstall"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("impl", IMPLS)
def test_padding_positions_get_no_expert(arch, impl):
    model, ids, routes = routed(arch, experts_impl=impl)
    routes[1, 6:] = NO_ROUTE  # the second sequence is padding from position 6
    seen, outs = [], []
    for m in model.modules():
        if type(m).__name__.endswith("Experts"):
            m.register_forward_pre_hook(lambda m, a: seen.append((a[1].clone(), a[2].clone())))
        if type(m).__name__.endswith("SparseMoeBlock"):
            m.register_forward_hook(lambda m, a, o: outs.append(o.detach()))
    with torch.no_grad():
        for m in model.modules():  # experts whose outputs for padding would be garbage, if ever computed
            if type(m).__name__.endswith("Experts"):
                m.down_proj[0].fill_(float("nan"))
    real = torch.ones(2, 9, dtype=torch.bool)
    real[1, 6:] = False
    g = torch.Generator().manual_seed(1)  # real positions avoid expert 0, so any use of it is padding's
    routes = torch.stack([torch.randperm(7, generator=g)[:2] + 1 for _ in range(routes[..., 0].numel())]).view_as(routes)
    routes[1, 6:] = NO_ROUTE
    with routing_replay(model, routes):
        logits = model(ids).logits
        logits[real].float().sum().backward()
    assert not any(getattr(m, "_is_expert_parallel", False) for m in model.modules())  # restored
    pad = torch.zeros(2, 9, dtype=torch.bool)
    pad[1, 6:] = True
    for (idx, w), out in zip(seen, outs):
        idx, w = idx.view(2, 9, 2), w.view(2, 9, 2)
        assert (idx[pad] == 8).all() and not (idx[pad] == 0).any(), "a padding position was sent to expert 0"
        assert (w[pad] == 0).all() and torch.isfinite(w).all()
        assert not out[pad].any()  # the MoE block contributes nothing there
    assert torch.isfinite(logits).all()
    with pytest.raises(RoutingReplayError, match="must be routed"):
        routing_replay(model, routes, required=torch.ones(2, 9, dtype=torch.bool))
    ok = torch.ones(2, 9, dtype=torch.bool)
    ok[1, 6:] = False
    routing_replay(model, routes, required=ok)


def test_bad_routes_and_misuse_raise_named_errors():
    model, ids, routes = routed("qwen3_moe")
    with pytest.raises(RoutingReplayError, match=r"\[T, 2, 2\]"):
        routing_replay(model, routes[..., :1])
    with pytest.raises(RoutingReplayError, match="outside 0..7"):
        routing_replay(model, torch.where(routes == routes.max(), 8, routes))
    partial = routes.clone()
    partial[0, 3, 1, 0] = NO_ROUTE
    with pytest.raises(RoutingReplayError, match="position 3 has routes in some"):
        routing_replay(model, partial)
    twice = routes.clone()
    twice[0, 0, 0, 1] = twice[0, 0, 0, 0]
    with pytest.raises(RoutingReplayError, match="twice"):
        routing_replay(model, twice)
    with pytest.raises(RoutingReplayError, match="integer"):
        routing_replay(model, routes.float())
    with routing_replay(model, routes):
        with pytest.raises(RoutingReplayError, match="already under routing_replay"):
            with routing_replay(model, routes):
                pass
        with pytest.raises(RoutingReplayError, match="routes 9 positions, the routes cover 18"):
            with torch.no_grad():
                model(ids[:1])
    dense = random_model(model_config("qwen2", hidden=32, layers=1, heads=4, kv_heads=2, intermediate=64))
    with pytest.raises(RoutingReplayError, match="no MoE router"):
        routing_replay(dense, routes)


def test_bind_swaps_routes_between_cached_forwards():
    model, ids, routes = routed("mixtral", B=1, T=10)
    from transformers import DynamicCache

    import inspect

    # transformers >= 5.20 calls it cache=, 5.19 (vLLM's pin) past_key_values= (as syncd.engine.reference.model does)
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        full = model(ids).logits
        cache = DynamicCache(config=model.config)
        with routing_replay(model, routes[:, :6]) as rr:
            a = model(ids[:, :6], use_cache=True, **{kw: cache}).logits
            rr.bind(routes[:, 6:])
            b = model(ids[:, 6:], use_cache=True, **{kw: cache}).logits
    torch.testing.assert_close(torch.cat([a, b], 1), full, atol=1e-5, rtol=1e-5)
    assert rr.disagreement == 0.0


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
def test_routing_replay_on_cuda_is_bit_identical_with_the_triton_gather(arch):
    model = tiny(arch).cuda()
    ids = ids_for(model).cuda()
    routes = own_routes(model, ids)
    want = model(ids).logits
    with routing_replay(model, routes):
        got = model(ids).logits
        loss_of(model, ids).backward()
    assert torch.equal(got, want)
    assert moe_routers(model)[0].weight.grad.abs().sum() > 0
