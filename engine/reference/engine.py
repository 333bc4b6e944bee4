"""``ReferenceEngine``: a real generation engine on PyTorch + transformers that takes weight updates while it
serves. It implements ``syncd.engines.Generator`` and ``syncd.engines.Adapter``: the update side is
:class:`~syncd.engines.in_place.InPlaceAdapter` over the runner's tensors; the engine supplies its pause/resume and
refreshes what its runner computes from written weights.

Serving: a background scheduler thread runs *steps*. Between steps, waiting requests join the running batch
(up to ``max_batch``) and finished or aborted ones leave it (continuous batching at the iteration level). In
a step every running request advances by one token: a new request runs its whole prompt (prefill, which may
already hold tokens generated elsewhere), the others their last token, each against its own KV cache, in its
own forward call, so its numbers never depend on its batch mates. Each token is sampled in float32 with the
request's seed at the token's absolute position (:mod:`syncd.engine.reference.sampling`): the same seed, prompt
and weights give the same tokens.

Updates (the Adapter contract in ``syncd/engines/protocol.py``): ``stage`` runs on the caller's thread while
steps go on; ``pause`` stops the scheduler before its next step and returns once the current step has finished (at
most one step); ``apply``/``rollback``/``load_full`` need the engine paused (``RuntimeError`` otherwise);
``resume`` lets the next step run. Running requests keep their KV caches across the update and go on with the
new weights; requests submitted while paused queue. Every token carries the version it was sampled with.

Thread-safety: ``generate``/``submit``/``abort``/``close`` from any thread; event callbacks run on the
scheduler thread and must not block (``generate`` hands events to the caller's event loop).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Mapping

import torch

from syncd.engine.reference.sampling import sample
from syncd.engines.in_place import InPlaceAdapter
from syncd.engines.protocol import GenerationRequest, SamplingParams, TokenEvent

log = logging.getLogger(__name__)

__all__ = ["ReferenceEngine", "EngineStats"]

Sink = Callable[[TokenEvent], None]


@dataclass(eq=False)
class _Live:
    """A request the engine holds (waiting or running). Touched by the scheduler thread, and under the
    engine lock by ``abort``."""

    req: GenerationRequest
    seed: int
    sink: Sink
    cache: object = None
    generated: list[int] = field(default_factory=list)
    aborted: bool = False
    done: bool = False


@dataclass
class EngineStats:
    """Counters since the engine started (read them at any time; updated by the scheduler thread)."""

    steps: int = 0
    tokens: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    step_seconds: float = 0.0


class ReferenceEngine(InPlaceAdapter):
    """See the module docstring. ``runner``: an :class:`~syncd.engine.reference.model.HFRunner` (or a
    tensor-parallel runner with the same interface) holding the weights of ``version``: its ``specs`` and
    ``local_tensors`` are what the updater writes, its ``weights_written`` (if any) is told what was written.
    ``recorder``: an optional :class:`~syncd.engine.replay.ReplayRecorder` that receives every token's replay
    record. ``max_batch``: requests running at once (others wait). ``verify_apply``: ``apply`` checks that every
    staged position still holds its staged old word as it writes (see ``WeightUpdater.apply``)."""

    def __init__(self, runner, *, version: int | None = None, recorder=None, max_batch: int = 8,
                 name: str = "reference", verify_apply: bool = True):
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        super().__init__(runner.specs, runner.local_tensors, version=version,
                         ignore_sources=getattr(runner, "aliases", ()), verify_apply=verify_apply,
                         written=getattr(runner, "weights_written", None))
        self.runner = runner
        self.name = name
        self.recorder = recorder
        self.max_batch = max_batch
        self.stats = EngineStats()
        self._cv = threading.Condition(threading.RLock())
        self._waiting: deque[_Live] = deque()
        self._running: list[_Live] = []
        self._live: dict[str, _Live] = {}
        self._pause_requested = False
        self._stepping = False
        self._closed = False
        if recorder is not None:
            recorder.configure(vocab_size=runner.vocab_size, num_experts=getattr(runner, "num_experts", 0))
        self._thread = threading.Thread(target=self._loop, name=f"{name}-scheduler", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------------ constructors

    @classmethod
    def from_pretrained(cls, folder, **kw) -> "ReferenceEngine":
        """From a local model folder (:func:`syncd.engine.reference.build.from_pretrained`)."""
        from syncd.engine.reference import build

        return build.from_pretrained(cls, folder, **kw)

    @classmethod
    def from_state_dict(cls, state_dict: Mapping[str, torch.Tensor], config, **kw) -> "ReferenceEngine":
        """From the trainer's tensors and their config (:func:`syncd.engine.reference.build.from_state_dict`)."""
        from syncd.engine.reference import build

        return build.from_state_dict(cls, state_dict, config, **kw)

    @classmethod
    def from_store(cls, store, run_id: str, version: int | None = None, **kw) -> "ReferenceEngine":
        """From a version of a run in the store (:func:`syncd.engine.reference.build.from_store`)."""
        from syncd.engine.reference import build

        return build.from_store(cls, store, run_id, version, **kw)

    # ------------------------------------------------------------------------------------ Adapter: its own

    @property
    def paused(self) -> bool:
        """True between ``pause`` returning and ``resume``."""
        with self._cv:
            return self._pause_requested and not self._stepping

    def pause(self) -> None:
        with self._cv:
            self._pause_requested = True
            while self._stepping:
                self._cv.wait()

    def resume(self) -> None:
        with self._cv:
            self._pause_requested = False
            self._cv.notify_all()

    def checksum(self, names=None) -> dict[str, int]:
        """The Adapter's checksums over the whole words the engine computes with. A bf16 weight held in an
        fp32 parameter (float32 compute, the runner's ``fp32_words``) must have all-zero low halves; the checksum
        of its bf16 words is reported as it is when they are, and complemented (so that it equals no manifest's)
        when any low half is set: weights that differ from the published bf16 values anywhere in their 32 bits
        never pass as bit-exact. Reading the low halves costs one pass over those tensors."""
        sums = super().checksum(names)
        words = getattr(self.runner, "fp32_words", {})
        for name, value in sums.items():
            full = words.get(name)
            if full is not None and bool(full.reshape(-1).view(torch.int16)[0::2].any()):  # little-endian low halves
                sums[name] = value ^ 0xFFFFFFFFFFFFFFFF
        return sums

    # ------------------------------------------------------------------------------------ Generator

    def submit(self, request: GenerationRequest, sink: Sink) -> None:
        """Queue ``request``; ``sink(event)`` is called on the scheduler thread for each token, the last one
        with a ``finish_reason``. Raises ValueError for a bad request (ids outside the vocabulary, an empty
        prompt, a request id already running, bad sampling parameters) and RuntimeError after ``close``."""
        self._check(request)
        seed = request.sampling.seed
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little") >> 1
        live = _Live(request, seed, sink)
        with self._cv:
            if self._closed:
                raise RuntimeError("engine is closed")
            if request.request_id in self._live:
                raise ValueError(f"request id {request.request_id!r} is already running")
            self._live[request.request_id] = live
            self._waiting.append(live)
            self._cv.notify_all()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """The request's tokens as they are generated (usable from any event loop). Closing the iterator
        early aborts the request."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def sink(ev: TokenEvent) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, ev)
            except RuntimeError:  # the caller's loop is gone
                self.abort(request.request_id)

        self.submit(request, sink)
        finished = False
        try:
            while True:
                ev = await queue.get()
                finished = ev.finish_reason is not None
                yield ev
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request.request_id)

    def generate_sync(self, request: GenerationRequest, timeout: float | None = None) -> list[TokenEvent]:
        """Blocking convenience: every event of ``request``. Raises TimeoutError after ``timeout`` seconds
        (the request is then aborted)."""
        events: list[TokenEvent] = []
        done = threading.Event()

        def sink(ev):
            events.append(ev)
            if ev.finish_reason is not None:
                done.set()

        self.submit(request, sink)
        if not done.wait(timeout):
            self.abort(request.request_id)
            raise TimeoutError(f"request {request.request_id!r} did not finish within {timeout} s "
                               f"({len(events)} tokens so far)")
        return events

    def abort(self, request_id: str) -> None:
        """End the request; its stream ends with ``finish_reason="abort"`` (an event with ``token_id=-1``,
        not a generated token). Unknown or finished ids are ignored."""
        with self._cv:
            live = self._live.get(request_id)
            if live is None or live.done:
                return
            live.aborted = True
            if not self._stepping:
                self._finish_aborted(live)

    def close(self, timeout: float = 30.0) -> None:
        """Stop the scheduler (after its current step) and abort every request still held."""
        with self._cv:
            self._closed = True
            self._pause_requested = False
            self._cv.notify_all()
        self._thread.join(timeout)
        with self._cv:
            for live in list(self._live.values()):
                live.aborted = True
                self._finish_aborted(live)
        if self.recorder is not None:
            self.recorder.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def load(self) -> tuple[int, int]:
        """(running, waiting) request counts."""
        with self._cv:
            return len(self._running), len(self._waiting)

    # ------------------------------------------------------------------------------------ scheduler

    def _check(self, request: GenerationRequest) -> None:
        sp: SamplingParams = request.sampling
        ids = request.prompt_token_ids
        if not ids:
            raise ValueError(f"request {request.request_id!r}: empty prompt")
        vocab = self.runner.vocab_size
        bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise ValueError(f"request {request.request_id!r}: token ids {bad[:4]} outside the vocabulary "
                             f"0..{vocab - 1}")
        if len(ids) >= self.runner.max_positions:
            raise ValueError(f"request {request.request_id!r}: prompt of {len(ids)} tokens leaves no room in "
                             f"{self.runner.max_positions} positions")
        if sp.max_tokens < 1:
            raise ValueError(f"request {request.request_id!r}: max_tokens must be at least 1")
        if sp.temperature < 0 or not 0 < sp.top_p <= 1 or sp.top_k < 0:
            raise ValueError(f"request {request.request_id!r}: need temperature >= 0, 0 < top_p <= 1, top_k >= 0")

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._closed and (self._pause_requested or not (self._waiting or self._running)):
                    self._cv.wait()
                if self._closed:
                    return
                while self._waiting and len(self._running) < self.max_batch:
                    self._running.append(self._waiting.popleft())
                batch = list(self._running)
                version = self.version
                self._stepping = True
            t0 = time.perf_counter()
            results = []
            try:
                for live in batch:
                    results.append(self._advance(live, version))
            finally:
                with self._cv:
                    self.stats.step_seconds += time.perf_counter() - t0
                    self.stats.steps += 1
                    self._stepping = False
                    for live, ev in zip(batch, results + [None] * (len(batch) - len(results))):
                        self._deliver(live, ev)
                    self._cv.notify_all()

    def _advance(self, live: _Live, version: int | None) -> TokenEvent | None:
        """One token for ``live`` (scheduler thread, outside the lock). None when the forward failed."""
        req, sp = live.req, live.req.sampling
        prompt = list(req.prompt_token_ids)
        try:
            if live.cache is None:
                live.cache = self.runner.new_cache()
                feed = prompt
            else:
                feed = [live.generated[-1]]
            logits, routing = self.runner.forward(live.cache, feed)
            position = len(prompt) + len(live.generated)
            s = sample(logits, sp, live.seed, position)
        except Exception:
            log.exception("request %r failed in a forward step; ending it", req.request_id)
            return None
        index = len(live.generated)
        live.generated.append(s.token_id)
        finish = None
        if s.token_id in sp.stop_token_ids:
            finish = "stop"
        elif index + 1 >= sp.max_tokens or position + 1 >= self.runner.max_positions:
            finish = "length"
        if self.recorder is not None:
            if routing is not None and len(feed) > 1:
                self.recorder.add_prompt_routing(req.request_id, position - len(feed), routing[:, :-1])
            self.recorder.add(req.request_id, position=position, index=index, version=version,
                              token_id=s.token_id, logprob=s.logprob, kept=s.ranked, kept_margins=s.margins,
                              routing=None if routing is None else routing[:, -1])
        return TokenEvent(req.request_id, index, s.token_id, s.logprob, version, finish)

    def _deliver(self, live: _Live, ev: TokenEvent | None) -> None:
        """Hand the step's token to the request's sink (under the lock)."""
        if live.done:
            return
        if live.aborted or ev is None:
            self._finish_aborted(live)
            return
        self.stats.tokens += 1
        if ev.finish_reason is not None:
            self._remove(live)
            self.stats.requests_finished += 1
        self._emit(live, ev)

    def _finish_aborted(self, live: _Live) -> None:
        self._remove(live)
        self.stats.requests_aborted += 1
        self._emit(live, TokenEvent(live.req.request_id, len(live.generated), -1, 0.0, self.version,
                                    "abort"))

    def _remove(self, live: _Live) -> None:
        live.done = True
        live.cache = None
        self._live.pop(live.req.request_id, None)
        if live in self._running:
            self._running.remove(live)
        else:
            try:
                self._waiting.remove(live)
            except ValueError:
                pass
        if self.recorder is not None:
            self.recorder.finish(live.req.request_id)

    def _emit(self, live: _Live, ev: TokenEvent) -> None:
        try:
            live.sink(ev)
        except Exception:
            log.exception("event callback of request %r failed", live.req.request_id)
