"""``VLLMEngine``: a real vLLM (``vllm.v1.engine.async_llm.AsyncLLM``) behind syncd's engine contract -- the
``Adapter`` (weight updates in place while serving) and the ``Generator`` (token streams with each token's
weight version).

How the Adapter maps onto vLLM (``docs/engine.md``, "vLLM"):

=============  =================================================================================================
``stage``      the worker decodes the update into CPU memory on a thread of its own while vLLM keeps serving
               (``collective_rpc("syncd_stage")``; the node-cache shards are read in the worker itself)
``pause``      ``pause_generation(mode="keep", clear_cache=False)``: requests stay queued, KV and prefix
               caches are kept; returns once no step runs
``apply``      vLLM's weight-transfer interface with the ``syncd`` backend (``syncd.engine.vllm.worker_ext``):
               ``start_weight_update`` -> ``update_weights({"op": "apply"})`` (the changed words written in
               place into vLLM's own parameters, the packed CPU copies of the touched layers rebuilt) ->
               ``finish_weight_update(weight_version=str(version))``, which labels every later token
``checksum``   ``syncd.ops.checksum`` on the worker over vLLM's parameters (the logical copy for packed experts)
``resume``     ``resume_generation()``
=============  =================================================================================================

``rollback`` and ``load_full`` go through the same backend. Bad input (a corrupt blob, a wrong base version, a
checksum that does not match) raises the error the reference engine raises and leaves the served weights as
they were. Versions are syncd's ints; vLLM's are their ``str``.

Threads: AsyncLLM lives on an event loop thread of its own; the Adapter's calls (one controller thread, as the
contract says) and ``generate``/``abort`` (any thread or loop) are handed to it. One AsyncLLM starts a
``VLLM::EngineCore`` process and a ``VLLM::Worker`` per tensor-parallel rank; :meth:`close` shuts them down.

Tensor parallelism (``engine_kwargs={"tensor_parallel_size": W}``): every rank stages, writes and checksums its
own slices; with ``W > 1`` the engine's parameters are named ``tp<rank>.<vLLM name>`` and the ranks' answers are
merged (:mod:`syncd.engine.vllm.ranks`). An apply that fails on some ranks is undone on the others. On CPU each rank
gets an equal share of the allowed cores, or of the one core list ``VLLM_CPU_OMP_THREADS_BIND`` names.

Replay records (``replay=ReplayConfig(store, run_id, ...)``): every request (unless ``generate(..., replay=False)``)
is sampled with syncd's logits processor (:mod:`syncd.engine.vllm.kept`: kept sets by construction) and recorded
inside the worker (:mod:`syncd.engine.vllm.recording`: tokens, kept sets, log-probs, versions, MoE routes) by a
:class:`syncd.engine.replay.ReplayRecorder` there. Recording turns off vLLM's asynchronous scheduling and, for a
MoE model, its prefix cache (a cached position is never run, so it would have no routes), and streams every
token's log-probability under the distribution it was sampled from (vLLM's ``processed_logprobs``; 0 for a
greedy replay request), as its record holds it.

On CPU a seeded request whose prefill vLLM chunks would end the engine (vLLM 0.32 rewinds its generator, which a
CPU generator cannot do): :mod:`syncd.engine.vllm.cpu_seeded_chunks` works around it in every worker.

A process killed with SIGKILL leaves the others running: run a serving process in its own session and kill its
group (``syncd.procs`` does).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from dataclasses import asdict
from typing import AsyncIterator, Sequence

from syncd.engine.vllm import ranks
from syncd.engine.vllm.replay_config import ReplayConfig, WorkerRecorders, model_facts
from syncd.engines.params import ParamSpec
from syncd.engines.protocol import GenerationRequest, TokenEvent
from syncd.engines.update import Update

log = logging.getLogger(__name__)

__all__ = ["VLLMEngine", "ReplayConfig", "WORKER_EXTENSION"]

WORKER_EXTENSION = "syncd.engine.vllm.worker_ext.SyncdWorkerExtension"


def _raise(res):
    """``res``, unless the worker sent an error: then raise it as the type it had there."""
    if isinstance(res, dict) and "error" in res:
        from syncd import errors

        kind, msg = res["error"]
        cls = getattr(errors, kind, None) or {"ValueError": ValueError, "KeyError": KeyError,
                                              "FileNotFoundError": FileNotFoundError}.get(kind, RuntimeError)
        raise cls(msg if cls is not RuntimeError or kind == "RuntimeError" else f"{kind}: {msg}")
    return res


class VLLMEngine:
    """vLLM serving ``model_dir`` (a local folder: config, safetensors, tokenizer) with the weights of
    ``version``. ``max_model_len`` (None: the model's), ``max_num_seqs``, ``block_size`` (CPU: a multiple of 32),
    ``kv_cache_gib`` (CPU KV cache, ``VLLM_CPU_KVCACHE_SPACE``) and ``engine_kwargs`` (any other
    ``AsyncEngineArgs``) configure vLLM; it always runs in float32 (the parameters hold the trainer's bf16
    words exactly) with eager execution. ``cpu_gemm``: how CPU linear layers compute, ``"onednn"`` (vLLM's packed
    copies, packed for the touched layers while staging; the default) or ``"torch"`` (``F.linear`` over the
    written weights; ``SYNCD_VLLM_CPU_GEMM``). ``replay``: record replay records (module docstring). Starting
    takes 20-60 s on a small CPU machine. Raises what vLLM raises when it cannot start, and ``ValueError`` for a
    model whose layout syncd cannot map."""

    def __init__(self, model_dir, *, version: int | None = 0, max_model_len: int | None = 512, max_num_seqs: int = 8,
                 block_size: int | None = 32, kv_cache_gib: float = 1, engine_kwargs: dict | None = None,
                 cpu_gemm: str | None = None, name: str = "vllm", start_timeout: float = 900.0,
                 replay: ReplayConfig | None = None):
        self.world_size = int((engine_kwargs or {}).get("tensor_parallel_size", 1))
        if self.world_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.world_size}")
        self.name = name
        self.model_dir = os.fspath(model_dir)
        self._version = version
        self._paused = False
        self.last_write: dict = {}  # what the workers reported for the last apply/rollback/load_full (merged)
        self._staged_version: int | None = None
        self.replay = replay
        self.vocab_size, self.num_experts = model_facts(self.model_dir)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"{name}-loop", daemon=True)
        self._thread.start()
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
        bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
        if self.world_size > 1 and "|" not in bind and bind != "nobind" and _on_cpu():
            # one group (e.g. this engine's share of a node, syncd.engine.dynamo.serve) or none: one share per rank
            cpus = None if bind == "auto" else ranks.parse_cpu_list(bind)
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ranks.cpu_thread_binding(self.world_size, cpus)
        if cpu_gemm is not None:  # read by syncd.engine.vllm.worker_ext in the worker, which inherits this environment
            os.environ["SYNCD_VLLM_CPU_GEMM"] = cpu_gemm
        args = dict(model=self.model_dir, dtype="float32", enforce_eager=True, max_num_seqs=max_num_seqs,
                    max_logprobs=-1, worker_extension_cls=WORKER_EXTENSION, weight_transfer_config={"backend": "syncd"})
        if max_model_len:
            args["max_model_len"] = max_model_len
        if block_size:
            args["block_size"] = block_size
        if replay is not None:
            from syncd.engine.vllm.kept import PROCESSOR

            # processed log-probs: a token's is under the distribution it was sampled from, as its record's
            args.update(logits_processors=[PROCESSOR], async_scheduling=False, logprobs_mode="processed_logprobs")
            if self.num_experts:
                args["enable_prefix_caching"] = False
        args.update(engine_kwargs or {})
        try:
            self.llm = self._run(self._start(args), start_timeout)
            self._run(self._init(version), start_timeout)
            self._specs = ranks.merge_specs([[self._spec(d) for d in r] for r in self._rpc_sync("syncd_specs")])
            if _on_cpu():
                self._rpc_sync("syncd_seeded_chunks_fix")
            if replay is not None:
                self.writer = self._rpc_sync("syncd_replay_start", **asdict(replay))[0]["writer"]
        except BaseException:
            self.close()
            raise

    async def _start(self, args):
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        return AsyncLLM.from_engine_args(AsyncEngineArgs(**args))

    async def _init(self, version):
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        await self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info={"version": version}))
        await self.llm.update_weight_version(str(version))

    @staticmethod
    def _spec(d) -> ParamSpec:
        from syncd.engines.wire import spec_from_json

        return spec_from_json(d)

    # ------------------------------------------------------------------------------------ plumbing

    def _run(self, coro, timeout: float | None = None):
        """Run ``coro`` on the engine's loop and wait for its result (from any other thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def run(self, fn, timeout: float | None = None):
        """``await fn(llm)`` on the engine's loop (the AsyncLLM must be used from there), from another thread:
        for what the contract does not cover (benchmarks, diagnostics)."""
        async def call():
            return await fn(self.llm)
        return self._run(call(), timeout)

    async def _rpc(self, method: str, **kwargs) -> list:
        """Every rank's answer to ``method`` (rank order); the first rank's error is raised."""
        return [_raise(r) for r in await self.llm.collective_rpc(method, kwargs=kwargs)]

    def _rpc_sync(self, method: str, **kwargs):
        return self._run(self._rpc(method, **kwargs))

    # ------------------------------------------------------------------------------------ Adapter

    @property
    def version(self) -> int | None:
        return self._version

    @property
    def paused(self) -> bool:
        return self._paused

    def parameters(self) -> Sequence[ParamSpec]:
        return list(self._specs)

    def stage(self, update: Update) -> dict:
        """Stage ``update`` in the worker while vLLM serves (see the module docstring); returns what the worker
        staged (``version``, ``words``, ``bytes``, ``seconds``)."""
        from syncd.engine.vllm.transfer import update_ref

        ref, path = update_ref(update)
        try:
            self._rpc_sync("syncd_stage", ref=ref)
            while True:
                polls = self._rpc_sync("syncd_stage_poll")
                if all(st["done"] for st in polls):
                    staged = ranks.merge_stage([_raise(st["result"]) for st in polls])
                    self._staged_version = staged["version"]
                    return staged
                time.sleep(0.005)
        finally:
            if path is not None:
                os.unlink(path)

    def pause(self) -> None:
        self._run(self.llm.pause_generation(mode="keep", clear_cache=False))
        self._paused = True

    def apply(self) -> None:
        self._need_pause("apply")
        self._write({"op": "apply"})
        self._staged_version = None

    def rollback(self) -> None:
        self._need_pause("rollback")
        self._write({"op": "rollback"})

    def load_full(self, update: Update) -> None:
        from syncd.engine.vllm.transfer import update_ref

        self._need_pause("load_full")
        ref, path = update_ref(update)
        try:
            self._write({"op": "load_full", "ref": ref})
        finally:
            if path is not None:
                os.unlink(path)

    def _write(self, info: dict) -> None:
        """One weight write through vLLM's weight-transfer interface (see the module docstring)."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        async def write():
            await self.llm.start_weight_update()
            try:
                await self.llm.update_weights(WeightTransferUpdateRequest(update_info=info))
            except Exception:  # vLLM ended the session; the failing rank restored its words and kept the error
                await self._after_failed_write(info)
                raise
            last = ranks.merge_write(await self._rpc("syncd_last"))
            await self.llm.finish_weight_update(weight_version=str(last["version"]))
            return last

        self.last_write = self._run(write())
        self._version = self.last_write["version"]

    async def _after_failed_write(self, info: dict) -> None:
        """All or nothing across ranks: the ranks whose part of a failed apply succeeded undo it and close their
        update session (vLLM closes it only where the write raised); a failed rollback or load_full that left the
        ranks on different versions leaves the engine's version unknown (None: the daemon rebuilds it). Then the
        first rank's typed error is raised."""
        lasts = await self.llm.collective_rpc("syncd_last")
        await self.llm.collective_rpc("syncd_end_update")
        if info["op"] == "apply" and self._staged_version is not None:
            await self._rpc("syncd_rollback_if", version=self._staged_version)
        versions = set(await self._rpc("syncd_version"))
        if len(versions) > 1:
            log.error("%s: the tensor-parallel ranks hold versions %s after a failed %s", self.name,
                      sorted(versions, key=str), info["op"])
            self._version = None
        for last in lasts:
            _raise(last)

    def resume(self) -> None:
        self._run(self.llm.resume_generation())
        self._paused = False

    def checksum(self, names: Sequence[str] | None = None) -> dict[str, int]:
        split = None if names is None else ranks.names_by_rank(list(names), self.world_size)
        return ranks.merge_checksums([r["checksums"] for r in self._rpc_sync("syncd_checksum", names=split)])

    def _need_pause(self, op: str) -> None:
        if not self._paused:
            raise RuntimeError(f"{op} needs the engine paused (call pause() first)")

    # ------------------------------------------------------------------------------------ Generator

    def check_request(self, request: GenerationRequest, replay: bool | None = None) -> bool:
        """Whether ``request`` is recorded (``replay``: True/False, or None for the engine's default: recorded
        when the engine has a replay store). Raises ValueError naming the field for a request that cannot be:
        ``replay`` asked of an engine without a replay store, ``temperature``, ``top_k`` (beyond the
        vocabulary), ``top_p`` (outside (0, 1])."""
        from syncd.engine.vllm.replay_config import check_request

        return check_request(request, replay, has_store=self.replay is not None, vocab_size=self.vocab_size)

    @property
    def recorder(self):
        """The replay recorders in the workers, as far as a caller flushes them (``flush(timeout)``); None
        without a replay store."""
        return None if self.replay is None else WorkerRecorders(self)

    def flush_replay(self, timeout: float = 60.0) -> dict:
        """Write every buffered replay record (running requests' too) and wait for the store; the recording
        worker's counters (``tokens``, ``missing``, ``recomputed``, ``route_conflicts``, ``written``...). Raises
        ``ReplayUploadError`` while the store refuses (the chunks stay queued), RuntimeError without a replay
        store."""
        if self.replay is None:
            raise RuntimeError("this engine records no replay records (start it with replay=ReplayConfig(...))")
        return next(r for r in self._rpc_sync("syncd_replay_flush", timeout=timeout) if r)

    async def generate(self, request: GenerationRequest, *, replay: bool | None = None) -> AsyncIterator[TokenEvent]:
        """The request's tokens as vLLM streams them (usable from any event loop); each carries the weight
        version vLLM sampled it with. ``replay``: see :meth:`check_request`. Closing the iterator early aborts
        the request. Raises ValueError for a request vLLM or :meth:`check_request` refuses."""
        record = self.check_request(request, replay)
        caller = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def put(item):
            try:
                caller.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the caller's loop is gone: nobody reads this stream
                self.abort(request.request_id)

        fut = asyncio.run_coroutine_threadsafe(self._pump(request, put, record), self._loop)
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item is None:
                    break
                finished = item.finish_reason is not None
                yield item
                if finished:
                    break
        finally:
            if not finished:
                self.abort(request.request_id)
            fut.cancel()

    async def _pump(self, request: GenerationRequest, put, record: bool) -> None:
        """On the engine's loop: stream the request from vLLM, hand TokenEvents to ``put`` (then None)."""
        from syncd.engine.vllm.kept import GREEDY_BELOW
        from syncd.engine.vllm.outputs import sampling_params, token_versions

        rid = request.request_id
        n = 0
        try:
            sp = sampling_params(request.sampling, replay_id=rid if record else None)
            point_mass = record and request.sampling.temperature < GREEDY_BELOW  # a greedy token's, as recorded
            prompt = {"prompt_token_ids": list(request.prompt_token_ids)}
            async for out in self.llm.generate(prompt, sp, request_id=rid):
                c = out.outputs[0]
                ids = list(c.token_ids)
                versions = token_versions(self.llm, rid, c, n, len(ids), fallback=self._version)
                lps = c.logprobs or [None] * len(ids)
                for i, (tok, lp) in enumerate(zip(ids, lps)):
                    last = out.finished and i == len(ids) - 1
                    logprob = 0.0 if point_mass else float(lp[tok].logprob) if lp and tok in lp else 0.0
                    put(TokenEvent(rid, n, int(tok), logprob, versions[i], _finish(c.finish_reason) if last else None))
                    n += 1
                if out.finished:
                    if not ids:  # finished (aborted) without a new token
                        put(TokenEvent(rid, n, -1, 0.0, self._version, _finish(c.finish_reason) or "abort"))
                    return
            put(TokenEvent(rid, n, -1, 0.0, self._version, "abort"))
        except asyncio.CancelledError:
            put(TokenEvent(rid, n, -1, 0.0, self._version, "abort"))
            raise
        except Exception as exc:  # noqa: BLE001 -- handed to the caller's iterator
            put(ValueError(f"request {rid!r}: {exc}") if n == 0 else exc)
        finally:
            put(None)

    def abort(self, request_id: str) -> None:
        """End the request (its stream ends with ``finish_reason="abort"``); unknown ids are ignored. Does not
        wait."""
        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(self.llm.abort(request_id), self._loop)

    def close(self) -> None:
        """Write the replay records still buffered, shut vLLM down (its processes end; about 5 s) and stop the
        loop thread."""
        llm = getattr(self, "llm", None)
        if llm is not None and self._loop.is_running():
            if self.replay is not None:
                try:
                    self._rpc_sync("syncd_replay_stop", timeout=60.0)
                except Exception:  # noqa: BLE001 -- the chunks stay spilled, where a spill directory was given
                    log.exception("replay records not all written at close")
            try:
                self._loop.call_soon_threadsafe(llm.shutdown)
                self._run(asyncio.sleep(0), 60)
            except Exception:  # noqa: BLE001
                log.exception("vLLM shutdown failed")
            self.llm = None
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _finish(reason) -> str | None:
    if reason is None:
        return None
    return {"stop": "stop", "length": "length", "abort": "abort"}.get(str(reason), str(reason))
