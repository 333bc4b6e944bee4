"""Routing replay: an MoE model selects the experts an engine recorded, while the combine weights come from the
model's live router logits through its own scoring and normalisation, so the router keeps its gradient.

    with routing_replay(model, routes) as rr:      # routes [B, T, L, k] or [T, L, k], NO_ROUTE (-1) = none
        logits = model(input_ids).logits
        loss = ...
        loss.backward()                            # checkpoint recomputes replay the same routes
    rr.disagreement                                # what the model's own routers would have chosen instead

How the installed transformers (5.x) builds its MoE blocks, and what is replaced: every sparse block holds a
router module (``Qwen3MoeTopKRouter``, ``MixtralTopKRouter``) whose ``forward(hidden)`` returns ``(router_logits,
scores, top_k_indices)``, and an experts module that runs ``experts(hidden, top_k_indices, scores)`` through
``config._experts_implementation`` (``grouped_mm`` by default, ``batched_mm`` or ``eager``). An index equal to
``num_experts`` is the expert-parallel sentinel: ``eager`` always skips it, ``grouped_mm``/``batched_mm`` only with
the experts' ``_is_expert_parallel`` flag, which replay sets while it has positions without routes. Inside the context each router's
``forward`` is replaced (an instance attribute, removed on exit): it runs the original router (the live logits,
and its own top-k for :attr:`RoutingReplay.disagreement`), then recomputes the scores of the *recorded* experts
with that router class's own formula (softmax in float32; for Qwen3-MoE the ``norm_topk_prob`` renormalisation
and the cast back to the logits' dtype, for Mixtral the renormalisation; the routed gather is
:func:`syncd.ops.replay.gather_routed`), and returns the recorded indices. Replaying a model's own routes gives
its outputs and gradients bit for bit (tested), which pins that these formulas are the model's.

Contracts:

* routes: integer, ``L`` = the model's MoE layers in module order (the order the engine records them), ``k`` =
  the router's ``top_k``, ids in ``[0, E)``, distinct per position, or every id :data:`NO_ROUTE` for a position
  without routes (padding; the last position of a sequence, which the engine never ran). A position without
  routes gets no expert (index ``E``, weight 0): it is never taken for expert 0. ``required`` (bool ``[B, T]``)
  names positions that must have routes (:class:`RoutingReplayError` otherwise).
* one forward per binding: each router call must cover exactly the ``B * T`` positions of ``routes``;
  :meth:`RoutingReplay.bind` swaps in the routes of the next forward (cached, segmented forwards).
* activation checkpointing (``model.gradient_checkpointing_enable()``): a recompute inside ``backward`` uses the
  same routes, also when the backward runs after the context exited: the replacement then stays until every
  graph made under replay is released, and meanwhile serves only recomputes (calls outside a backward run the
  original router). Reentrant checkpointing needs the backward inside the context.
* thread-safety: one context per model at a time (nesting raises); the model's forward on one thread.
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass

import torch

from syncd.errors import SyncdError
from syncd.ops.replay import NO_ROUTE, gather_routed

log = logging.getLogger(__name__)

__all__ = ["RoutingReplay", "RoutingReplayError", "routing_replay", "observe_routing", "moe_routers",
           "SUPPORTED_ROUTERS", "NO_ROUTE"]

_ATTR = "_syncd_routing_replay"


class RoutingReplayError(SyncdError, ValueError):
    """Routes that do not fit the model, or a use of routing replay that would replay the wrong routes."""


def _denominator(top: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
    # positions without routes have weights 0; divide them by 1, not by their sum 0
    s = top.sum(dim=-1, keepdim=True)
    return torch.where(routed[:, None], s, torch.ones_like(s))


def _qwen3_moe_scores(router, logits: torch.Tensor, routes: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
    # transformers.models.qwen3_moe.Qwen3MoeTopKRouter.forward, with the recorded experts for topk
    probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
    top = gather_routed(probs, routes)
    if router.norm_topk_prob:
        top = top / _denominator(top, routed)
    return top.to(logits.dtype)


def _mixtral_scores(router, logits: torch.Tensor, routes: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
    # transformers.models.mixtral.MixtralTopKRouter.forward, with the recorded experts for topk
    probs = torch.nn.functional.softmax(logits.float(), dim=-1)
    top = gather_routed(probs, routes)
    return top / _denominator(top, routed)


#: router class name -> scoring of recorded experts (the class's own formula)
SUPPORTED_ROUTERS = {"Qwen3MoeTopKRouter": _qwen3_moe_scores, "MixtralTopKRouter": _mixtral_scores}


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's MoE routers in module (= layer) order. Raises :class:`RoutingReplayError` for a router class
    routing replay does not know, or when there is none."""
    out = []
    for name, m in model.named_modules():
        cls = type(m).__name__
        if cls in SUPPORTED_ROUTERS:
            out.append(m)
        elif cls.endswith("Router") and hasattr(m, "top_k"):
            raise RoutingReplayError(f"{name}: router class {cls} is not supported by routing replay (supported: "
                                     f"{', '.join(SUPPORTED_ROUTERS)})")
    if not out:
        raise RoutingReplayError(f"{type(model).__name__} has no MoE router (supported: {', '.join(SUPPORTED_ROUTERS)})")
    return out


def _in_backward() -> bool:
    # the test torch's own module tracker and FSDP2 use to tell a backward's recomputation from a forward
    return torch._C._current_graph_task_id() != -1


@dataclass
class _Binding:
    routes: torch.Tensor  # [N, L, k] int64 on the routers' device; NO_ROUTE rows allowed
    routed: torch.Tensor  # [N] bool


class _Anchor(torch.autograd.Function):
    """Identity that keeps ``token`` alive as long as the autograd graph holding it (a recompute may need the
    routes until then)."""

    @staticmethod
    def forward(ctx, x, token):
        ctx.token = token
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Token:
    pass


class RoutingReplay:
    """The context :func:`routing_replay` returns (see the module docstring). ``disagreement``: the fraction of
    routed (position, layer) pairs, over every forward so far, where the model's own router chose another
    set of experts than the routes; ``disagreement_by_layer`` the same per layer."""

    def __init__(self, model: torch.nn.Module, routes, *, required=None, replay: bool = True):
        self.model = model
        self.replay = replay
        self.routers = moe_routers(model)
        self.num_layers = len(self.routers)
        self.top_k = int(self.routers[0].top_k)
        self.num_experts = int(self.routers[0].num_experts)
        if any(int(r.top_k) != self.top_k or int(r.num_experts) != self.num_experts for r in self.routers):
            raise RoutingReplayError("the model's routers differ in top_k or num_experts")
        self._lock = threading.Lock()
        self._active = False
        self._pending = 0  # graphs made under replay that a checkpoint recompute may still need
        self._fresh_forward = False  # an unreplayed forward with grad ran while lingering
        self._installed = False
        self._flagged: list[tuple[torch.nn.Module, bool]] = []  # experts whose sentinel flag replay set
        self._binding = self._check(routes, required)
        dev = self._binding.routes.device  # counted where the routes are: no host sync per layer
        self._disagree = torch.zeros(self.num_layers, dtype=torch.int64, device=dev)
        self._total = torch.zeros(self.num_layers, dtype=torch.int64, device=dev)

    # ------------------------------------------------------------------------------------ routes

    def _check(self, routes, required) -> _Binding:
        r = torch.as_tensor(routes)
        L, k, E = self.num_layers, self.top_k, self.num_experts
        if r.dtype.is_floating_point or r.dtype == torch.bool or r.dim() not in (3, 4) or tuple(r.shape[-2:]) != (L, k):
            raise RoutingReplayError(f"routes must be integer [T, {L}, {k}] or [B, T, {L}, {k}] ({L} MoE layers, "
                                     f"top_k {k}); got {r.dtype} of shape {tuple(r.shape)}")
        lead = tuple(r.shape[:-2])
        flat = r.reshape(-1, L, k).to(torch.int64)
        if flat.numel() and (int(flat.min()) < NO_ROUTE or int(flat.max()) >= E):
            raise RoutingReplayError(f"routes hold expert ids outside 0..{E - 1} (and {NO_ROUTE} for no route)")
        none = flat == NO_ROUTE
        per_pos = none.reshape(flat.shape[0], -1)
        partial = per_pos.any(1) & ~per_pos.all(1)
        if bool(partial.any()):
            pos = int(torch.nonzero(partial)[0])
            raise RoutingReplayError(f"position {pos} has routes in some layers or slots and {NO_ROUTE} in others")
        routed = ~per_pos.all(1) if per_pos.shape[1] else torch.ones(flat.shape[0], dtype=torch.bool)
        s = flat.sort(dim=-1).values
        if bool(((s[..., 1:] == s[..., :-1]) & (s[..., 1:] >= 0)).any()):
            raise RoutingReplayError("an expert appears twice among one position's routes in one layer")
        if required is not None:
            req = torch.as_tensor(required, dtype=torch.bool)
            if tuple(req.shape) != lead:
                raise RoutingReplayError(f"required must have the routes' leading shape {lead}, got {tuple(req.shape)}")
            missing = req.reshape(-1).to(routed.device) & ~routed
            if bool(missing.any()):
                pos = int(torch.nonzero(missing)[0])
                raise RoutingReplayError(f"position {pos} (flattened) must be routed but has no routes "
                                         f"({int(missing.sum())} such positions)")
        dev = self.routers[0].weight.device
        return _Binding(flat.to(dev), routed.to(dev))

    def bind(self, routes, *, required=None) -> None:
        """Use ``routes`` for the next forward (checked like the constructor's). Raises
        :class:`RoutingReplayError` while a graph made under the current routes awaits a checkpointed backward."""
        binding = self._check(routes, required)
        with self._lock:
            if self._pending and self._checkpointing():
                raise RoutingReplayError("cannot bind new routes while a graph made under the current ones awaits "
                                         "its backward with activation checkpointing (run backward first)")
            self._binding = binding
            if self._installed:
                self._flag_sentinels()

    @property
    def disagreement(self) -> float:
        total = int(self._total.sum())
        return int(self._disagree.sum()) / total if total else 0.0

    @property
    def disagreement_by_layer(self) -> list[float]:
        return [int(d) / int(t) if int(t) else 0.0 for d, t in zip(self._disagree, self._total)]

    @property
    def routed_pairs(self) -> int:
        """(position, layer) pairs replayed by forwards so far (recomputes not counted)."""
        return int(self._total.sum())

    # ------------------------------------------------------------------------------------ install

    def _checkpointing(self) -> bool:
        return any(getattr(m, "gradient_checkpointing", False) for m in self.model.modules())

    def __enter__(self) -> "RoutingReplay":
        for r in self.routers:
            if hasattr(r, _ATTR):
                raise RoutingReplayError("the model is already under routing_replay (or its lingering recompute "
                                         "routes): one at a time")
        for layer, r in enumerate(self.routers):
            original = type(r).forward.__get__(r)
            setattr(r, _ATTR, self)
            r.forward = self._make_forward(r, layer, original)
        self._installed = True
        self._flag_sentinels()
        self._active = True
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._active = False
            linger = self._pending > 0 and self._checkpointing()
        if linger:
            log.debug("routing replay: %d graph(s) await a checkpointed backward; routes stay for recomputes",
                      self._pending)
        else:
            self._uninstall()

    def _uninstall(self) -> None:
        if not self._installed:
            return
        self._installed = False
        for r in self.routers:
            if getattr(r, _ATTR, None) is self:
                delattr(r, _ATTR)
                del r.forward
        for experts, before in self._flagged:
            experts._is_expert_parallel = before
        self._flagged = []

    def _flag_sentinels(self) -> None:
        """Make the experts skip the sentinel index (positions without routes) whatever their implementation."""
        if self._flagged or not self.replay or bool(self._binding.routed.all()):
            return
        for m in self.model.modules():
            if hasattr(m, "_is_expert_parallel"):
                self._flagged.append((m, m._is_expert_parallel))
                m._is_expert_parallel = True

    def _released(self) -> None:
        with self._lock:
            self._pending -= 1
            done = self._pending == 0 and not self._active
        if done:
            self._uninstall()

    def _make_forward(self, router, layer: int, original):
        scoring = SUPPORTED_ROUTERS[type(router).__name__]
        E = self.num_experts

        def forward(hidden_states):
            recompute = _in_backward()
            if not self._active and not recompute:  # lingering: only recomputes replay
                if torch.is_grad_enabled():
                    self._fresh_forward = True
                return original(hidden_states)
            if not self._active and self._fresh_forward:
                raise RoutingReplayError("a checkpointed backward recomputes a layer after routing_replay exited "
                                         "and another forward ran since: cannot tell which routes it needs; run "
                                         "backward inside the routing_replay context")
            binding = self._binding
            logits, own_scores, own = original(hidden_states)
            if logits.shape[0] != binding.routes.shape[0]:
                raise RoutingReplayError(f"MoE layer {layer} routes {logits.shape[0]} positions, the routes cover "
                                         f"{binding.routes.shape[0]} (one forward per binding: see bind())")
            routes = binding.routes[:, layer, :]
            if not self.replay:
                if not recompute:
                    self._count(layer, own, routes, binding.routed)
                return logits, own_scores, own
            scores = scoring(router, logits, routes, binding.routed)
            indices = torch.where(routes >= 0, routes, torch.full_like(routes, E)).to(own.dtype)
            if not recompute:
                self._count(layer, own, routes, binding.routed)
                if torch.is_grad_enabled() and scores.requires_grad:
                    token = _Token()
                    with self._lock:
                        self._pending += 1
                    weakref.finalize(token, self._released)
                    scores = _Anchor.apply(scores, token)
            return logits, scores, indices

        return forward

    def _count(self, layer: int, own: torch.Tensor, routes: torch.Tensor, routed: torch.Tensor) -> None:
        with torch.no_grad():
            differ = (own.sort(dim=-1).values != routes.sort(dim=-1).values).any(dim=-1) & routed
            self._disagree[layer] += differ.sum()
            self._total[layer] += routed.sum()


def routing_replay(model: torch.nn.Module, routes, *, required=None) -> RoutingReplay:
    """A context manager in which every MoE router of ``model`` selects ``routes`` (see the module docstring).
    Raises :class:`RoutingReplayError` for routes that do not fit the model, an unsupported router, or nesting."""
    return RoutingReplay(model, routes, required=required)


def observe_routing(model: torch.nn.Module, routes) -> RoutingReplay:
    """Like :func:`routing_replay`, but the model routes as it would (nothing is replaced in its outputs): the
    context only counts where its routers disagree with ``routes`` (:attr:`RoutingReplay.disagreement`)."""
    return RoutingReplay(model, routes, replay=False)
