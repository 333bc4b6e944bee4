"""Replay records from inside vLLM's worker: :class:`ReplayTap` writes, for every token vLLM samples for a replay
request, the record the reference engine writes (``syncd.engine.reference.engine``; ``docs/replay-format.md``) to a
:class:`syncd.engine.replay.ReplayRecorder` in the worker process.

What it reads, per engine step, and from where (vLLM 0.32's V1 model runner, ``vllm/v1/worker/gpu_model_runner.py``,
which the CPU runner subclasses):

=========================  ====================================================================================
record field               source
=========================  ====================================================================================
request id                 ``SamplingParams.extra_args["syncd_replay"]["request_id"]`` (vLLM's own id carries a
                           random suffix)
``position``, ``index``    the request's prompt length and output length in the runner's ``CachedRequestState``
                           before the step; a row whose sampled token vLLM discards (a chunk of a chunked
                           prefill) records nothing
``token_id``               the runner's ``ModelRunnerOutput.sampled_token_ids`` of the step
``kept``, ``logprob``      the kept set :class:`syncd.engine.vllm.kept.SyncdKeptSets` computed and masked for the
                           row, and the token's log-probability under the softmax over it (0 and the token
                           alone when greedy)
``version``                the worker's weight version (``WeightUpdater.version``): weights change only while
                           vLLM is paused between steps
routes                     every MoE router's top-k ids of the forward (vLLM's ``set_capture_fn`` hook on each
                           ``MoERunner``'s router, logical ids before any EPLB mapping), cut by the batch layout
                           (requests in the input batch's order, ``num_scheduled_tokens`` each, from
                           ``num_computed_tokens``)
=========================  ====================================================================================

Routes: a token's record gets the routes of the position whose logits sampled it (the last position the step
ran for the request); the other positions a request's prefill ran (one step, or several with chunked prefill)
are its prompt routing, written with its first token. A position already routed is not recorded again: a
preempted request's recompute runs its positions once more (:attr:`ReplayTap.recomputed` counts them,
:attr:`ReplayTap.route_conflicts` those routed otherwise than recorded); the records keep the first run's routes.
Positions served from vLLM's prefix cache are not run, so they have no routes: the engine turns prefix caching
off for a MoE model it records (``syncd.engine.vllm.engine``).

The tap wraps the runner's ``execute_model`` (the step's scheduler output; requests that finished) and
``sample_tokens`` (the sampled tokens) as instance attributes; asynchronous scheduling, where tokens are read
back a step late, is turned off by the engine. Threads: vLLM's worker thread only.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from syncd.engine.vllm.kept import GREEDY_BELOW, ReplayArgs, SyncdKeptSets, replay_args_of
from syncd.engine.vllm.replay_config import moe_shape

log = logging.getLogger(__name__)

__all__ = ["ReplayTap"]


@dataclass
class _Request:
    """A replay request as the tap follows it: its arguments, the routes of the positions it ran so far
    (``[layers, m, top_k]`` pieces covering ``routed_from .. routed_upto - 1``) and whether its first token is
    written (until then every position it ran but the last is its prompt routing)."""

    args: ReplayArgs
    routed_from: int = 0
    routed_upto: int = 0
    routes: list[np.ndarray] = field(default_factory=list)
    started: bool = False


class ReplayTap:
    """Records the replay requests of one vLLM model runner into ``recorder`` (see the module docstring).
    ``version``: a callable giving the worker's current weight version. Raises RuntimeError when the runner has
    no :class:`~syncd.engine.vllm.kept.SyncdKeptSets` (vLLM was started without it), ValueError for a MoE model
    whose routers vLLM cannot report."""

    def __init__(self, runner, recorder, version):
        self.runner, self.recorder, self.version = runner, recorder, version
        procs = [p for p in runner.input_batch.logitsprocs.argmax_invariant if isinstance(p, SyncdKeptSets)]
        if not procs:
            raise RuntimeError("vLLM runs without syncd's logits processor (logits_processors="
                               "['syncd.engine.vllm.kept:SyncdKeptSets']); it cannot record replay")
        self.kept = procs[0]
        hf = runner.model_config.hf_text_config
        self.num_experts, self.top_k = moe_shape(hf)
        recorder.configure(vocab_size=int(hf.vocab_size), num_experts=self.num_experts)
        self.requests: dict[str, _Request] = {}
        self.tokens = self.missing = self.recomputed = self.route_conflicts = 0
        self.record_s = 0.0  # spent recording, in all (the processor's own time: SyncdKeptSets.seconds)
        self._routes: dict[int, np.ndarray] = {}  # layer id -> the step's [tokens, top_k] expert ids
        self._layers: list[int] = []
        self._sched = None
        if self.num_experts:
            self._layers = self._bind_routers(runner.get_model())
        self._execute, self._sample = runner.execute_model, runner.sample_tokens
        runner.execute_model, runner.sample_tokens = self._execute_model, self._sample_tokens

    def close(self) -> None:
        """Unwrap the runner and unbind the routers (the recorder is the caller's)."""
        self.runner.execute_model, self.runner.sample_tokens = self._execute, self._sample
        if self.num_experts:
            for module in self.runner.get_model().modules():
                router = getattr(module, "router", None)
                if hasattr(router, "set_capture_fn") and hasattr(module, "layer_id"):
                    router.set_capture_fn(None)

    def stats(self) -> dict:
        return {"tokens": self.tokens, "missing": self.missing, "recomputed": self.recomputed,
                "route_conflicts": self.route_conflicts, "requests": len(self.requests),
                "processor_calls": self.kept.calls, "moe_layers": len(self._layers), "record_s": self.record_s,
                "processor_s": self.kept.seconds}

    # ------------------------------------------------------------------------------------ routes

    def _bind_routers(self, model) -> list[int]:
        from vllm.model_executor.layers.fused_moe.layer import MoERunner
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        layers = []
        for module in model.modules():
            if isinstance(module, MoERunner):
                if module._quant_method.is_monolithic or not isinstance(module.router, BaseRouter):
                    raise ValueError(f"routes cannot be recorded from vLLM's MoE layer {module.layer_id} "
                                     f"({type(module.router).__name__}, a monolithic kernel?)")
                module.router.set_capture_fn(partial(self._capture, module.layer_id))
                layers.append(module.layer_id)
        if not layers:
            raise ValueError("the model's config names experts, but vLLM's model has no MoE router to record")
        return sorted(layers)

    def _capture(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        self._routes[layer_id] = topk_ids.detach().to("cpu", torch.int16, copy=True).numpy()

    # ------------------------------------------------------------------------------------ the step

    def _execute_model(self, scheduler_output, *args, **kwargs):
        for rid in scheduler_output.finished_req_ids:
            req = self.requests.pop(rid, None)
            if req is not None:
                self.recorder.finish(req.args.request_id)
        self._routes.clear()
        self._sched = scheduler_output
        return self._execute(scheduler_output, *args, **kwargs)

    def _sample_tokens(self, *args, **kwargs):
        sched, self._sched = self._sched, None
        batch = self.runner.input_batch
        if sched is None or self.runner.execute_model_state is None or not sched.total_num_scheduled_tokens:
            return self._sample(*args, **kwargs)
        layout, start = [], 0
        for row, rid in enumerate(batch.req_ids[:batch.num_reqs]):
            n = int(sched.num_scheduled_tokens.get(rid, 0))
            state = self.runner.requests.get(rid)
            req = self._request(rid, state)
            if req is not None:
                layout.append((row, rid, req, state, start, n, int(batch.num_computed_tokens_cpu[row]),
                               len(state.output_token_ids)))
            start += n
        out = self._sample(*args, **kwargs)
        kept, self.kept.step = self.kept.step, {}
        if layout:
            t0 = time.perf_counter()
            self._record(layout, out, kept)
            self.record_s += time.perf_counter() - t0
        return out

    def _request(self, rid: str, state) -> _Request | None:
        req = self.requests.get(rid)
        if req is None and state is not None and state.sampling_params is not None:
            try:
                args = replay_args_of(state.sampling_params)
            except ValueError:  # refused by the processor's validate_params before it got here
                args = None
            if args is not None:
                req = self.requests[rid] = _Request(args)
        return req

    def _record(self, layout, out, kept) -> None:
        version = self.version()
        routes = None
        if self._layers:
            if set(self._routes) != set(self._layers):
                log.error("replay: the step routed layers %s, expected %s", sorted(self._routes), self._layers)
            else:
                routes = np.stack([self._routes[i] for i in self._layers])  # [L, tokens, k]
        index = out.req_id_to_index
        for row, rid, req, state, at, n, first, out_len in layout:
            sampled = out.sampled_token_ids[index[rid]] if rid in index else []
            mine = None if routes is None else routes[:, at:at + n]
            position = len(state.prompt_token_ids or ()) + out_len
            if sampled and first + n != position:
                log.error("replay: request %s ran positions %d..%d but samples position %d; not recorded",
                          req.args.request_id, first, first + n - 1, position)
                self.missing += 1
                continue
            route = self._routes_of(req, mine, first, n, bool(sampled))
            if not sampled:
                continue
            self._add(req, row, position, out_len, int(sampled[0]), version, kept, route)

    def _routes_of(self, req: _Request, mine, first: int, n: int, sampled: bool):
        """Keep the routes of positions ``first .. first+n-1`` not recorded yet (a recompute's positions recorded
        before are compared, not kept); returns the last position's ``[L, k]`` when it sampled a token."""
        if mine is None:
            return None
        if not req.routes:
            req.routed_from = req.routed_upto = first
        skip = max(0, min(n, req.routed_upto - first))
        if skip:
            self.recomputed += skip
            self.route_conflicts += self._conflicts(req, mine[:, :skip], first)
        new = mine[:, skip:]
        if new.shape[1]:
            req.routes.append(new)
            req.routed_upto += new.shape[1]
        return new[:, -1] if sampled and new.shape[1] else None

    def _conflicts(self, req: _Request, again: np.ndarray, first: int) -> int:
        """How many of ``again``'s positions (from ``first``) the recorded routes route otherwise."""
        held = np.concatenate(req.routes, 1)
        req.routes = [held]
        lo = max(first, req.routed_from)
        hi = first + again.shape[1]
        if hi <= lo:
            return 0
        a = np.sort(again[:, lo - first:], -1)
        b = np.sort(held[:, lo - req.routed_from:hi - req.routed_from], -1)
        return int((a != b).any(-1).any(0).sum())

    def _add(self, req: _Request, row: int, position: int, index: int, token: int, version, kept, route) -> None:
        a, rid = req.args, req.args.request_id
        if a.temperature < GREEDY_BELOW:
            ids, margins, logprob = np.array([token]), None, 0.0
        else:
            k = kept.get(row)
            logprob = None if k is None else k.logprob_of(token)
            if logprob is None:
                log.error("replay: request %s token %d at position %d has no kept set (%s); not recorded", rid,
                          token, position, "outside it" if k is not None else "the processor did not run")
                self.missing += 1
                return
            ids, margins = k.ids, k.gaps
        if not req.started and route is not None and req.routed_upto - req.routed_from > 1:
            req.routes = [np.concatenate(req.routes, 1)]
            self.recorder.add_prompt_routing(rid, req.routed_from, req.routes[0][:, :-1])
        req.started = True
        self.recorder.add(rid, position=position, index=index, version=version, token_id=token, logprob=logprob,
                          kept=ids, kept_margins=margins, routing=route)
        self.tokens += 1
