"""Serve any ``syncd.engines.Adapter`` + ``syncd.engines.Generator`` engine as an NVIDIA Dynamo worker.

:class:`DynamoWorker` registers the engine's model with the frontend (``ModelInput.Tokens``, chat and
completions: the frontend tokenizes and applies the chat template), serves token generation on the endpoint
``<namespace>.<component>.<endpoint>`` and exposes the weight-update lifecycle as admin routes on the
worker's system port (``DYN_SYSTEM_PORT``)::

    POST /engine/weights/<op>     op in syncd.engines.wire.OPS: version, lease, release, parameters, checksum,
                                  stage, pause, apply, rollback, load_full, resume  (contract: syncd/engines/control.py)

so the node daemon drives the engine through ``syncd.engines.RemoteAdapter("http://host:system_port")``.
The routes go through an :class:`syncd.engines.control.EngineControl`: every call must carry the node's engine
token (``--engine-token-file`` / ``SYNCD_ENGINE_TOKEN_FILE``) as the body member ``"auth"`` (Dynamo hands a route
only its body), weight ops need the caller's lease, and with ``SYNCD_SIGNING_KEY``/``_FILE`` set the worker
verifies every manifest's signature itself. Weight ops run one at a time on a worker thread; generation goes
on meanwhile (``pause`` stops it between two engine steps, as the Adapter contract says). A failed op
replies HTTP 500 with
``{"error": "Handler error", "message": "Python callback failed: <ExceptionClass>: <message>"}`` (Dynamo's
system server fixes that shape; the exception class is kept in the message).

Requests: see :mod:`syncd.engine.dynamo.protocol` -- per-request ``max_tokens``, stop tokens, temperature/top-k/
top-p/seed; a request it refuses (an option the engine cannot honour, a malformed member, settings the engine
cannot record replay with, replay asked of a worker without ``--replay-store``: :mod:`syncd.engine.dynamo.engines`)
reaches the client as HTTP 400 with the reason; a prompt that already holds generated tokens (a migrated request)
simply continues.
Every chunk carries the engine's request id, token ids, log-probabilities and the weight version of each token in
``engine_data``. A client that goes away (the frontend stops the request) aborts the engine request.

Stopping: on SIGTERM (or SIGINT) the worker leaves discovery at once (no new requests reach it), lets
in-flight requests finish for up to ``drain_timeout_s``, then exits; requests still running then are cut by
the exit, and a frontend with ``--migration-limit`` moves them to another worker. A second signal exits at
once. Killed without a chance to deregister (SIGKILL), the worker stays listed until its discovery lease
expires (about 10 s with file discovery, 30 s with etcd); the frontend migrates its streams meanwhile.

Registration: by default the worker starts with weights of no version, serves its admin routes at once and
registers with the frontend only once the node daemon has loaded the newest version (its rebuild: the newest full
version plus the deltas after it, paused throughout) and resumed it: a (re)started worker never serves stale
weights. ``--weights-version V`` opts out: the folder's weights are run version V, registered at once (a node that
starts with its run; ``syncd serve`` restarts a worker without it). A worker on whom no node daemon took a lease
within :data:`UNMANAGED_WARNING_S` of registering says so (WARNING). The ready file names the registered version.

Engines (:mod:`syncd.engine.dynamo.engines`): ``--engine reference`` (:class:`syncd.engine.reference.ReferenceEngine`),
``--engine vllm`` (:class:`syncd.engine.vllm.VLLMEngine`, the ``vllm`` extra; run the worker in its own session and stop
it by its process group: vLLM's engine-core and worker processes outlive a SIGKILLed parent) or ``MODULE:FACTORY``;
with ``--replay-store`` either records every request.

CLI: ``syncd-dynamo-worker --model DIR [--engine reference|vllm|MODULE:FACTORY] ...`` (or ``python -m
syncd.engine.dynamo.worker``; ``--help``). A taken ``--system-port`` is refused (exit 2) before the model loads.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import uuid
from pathlib import Path

from syncd.cli_help import HelpFormatter
from syncd.engine.dynamo import protocol
from syncd.engine.dynamo.engines import build_engine, check_replay
from syncd.engine.dynamo.procs import MAX_SYSTEM_PORT
from syncd.procs import port_taken
from syncd.engine.dynamo.settings import DynamoSettings, add_arguments, from_args

log = logging.getLogger(__name__)

__all__ = ["DynamoWorker", "main", "build_engine", "WEIGHT_ROUTE_PREFIX"]

WEIGHT_ROUTE_PREFIX = "weights/"
#: seconds a registered worker waits for a node daemon's lease before it warns that nobody manages its weights
UNMANAGED_WARNING_S = 60.0


class DynamoWorker:
    """One engine served as a Dynamo worker (see the module docstring).

    ``engine``: implements ``syncd.engines.Adapter`` and ``syncd.engines.Generator``. ``model_dir``: the folder the
    frontend reads the tokenizer, chat template and config from. ``served_name``: the OpenAI model name.
    ``default_max_tokens``: for requests without ``max_tokens``. ``drain_timeout_s``: how long a stopping
    worker lets in-flight requests finish. ``ready_file``: written (atomically, JSON ``{"pid", "system_port",
    "instance_id", "endpoint"}``) once the worker is reachable through discovery. ``wait_for_weights``: register
    once the engine holds a version and is not paused (at once for an engine built with a version).

    The instance is used from its runtime's event loop only (:meth:`run`); the engine's own threads are the
    engine's business (its ``generate`` is usable from any loop)."""

    def __init__(self, engine, *, model_dir: str | os.PathLike, served_name: str, namespace: str = "syncd",
                 component: str = "backend", endpoint: str = "generate",
                 default_max_tokens: int = protocol.DEFAULT_MAX_TOKENS, drain_timeout_s: float = 30.0,
                 ready_file: str | os.PathLike | None = None, context_length: int | None = None,
                 token: str | None = None, run_id: str | None = None, signing_key=None,
                 wait_for_weights: bool = True):
        from syncd.engines.control import EngineControl
        from syncd.engine_token import load_or_create

        self.engine = engine
        self.control = EngineControl(engine, token=token or load_or_create(), signing_key=signing_key,
                                     run_id=run_id)
        self.model_dir = str(model_dir)
        self.served_name = served_name
        self.endpoint_path = f"{namespace}.{component}.{endpoint}"
        self.default_max_tokens = default_max_tokens
        self.drain_timeout_s = drain_timeout_s
        self.ready_file = None if ready_file is None else Path(ready_file)
        self.context_length = context_length
        self.wait_for_weights = wait_for_weights
        self.runtime = None
        self.endpoint = None
        self.registered_version = None
        self._live: set[str] = set()
        self._stopping = False
        self.requests_served = 0

    # ------------------------------------------------------------------------------------ generation

    def _engine_request_id(self, context) -> str:
        rid = context.id() if context is not None else None
        rid = rid or uuid.uuid4().hex
        if rid in self._live:  # the same request routed here again while its first run still ends
            n = 1
            while f"{rid}~{n}" in self._live:
                n += 1
            rid = f"{rid}~{n}"
        return rid

    async def generate(self, request, context=None):
        """The endpoint handler: an async generator of output chunks for one frontend request."""
        rid = self._engine_request_id(context)
        if protocol.nothing_left(request):
            log.info("request %s migrated with no tokens left to make; ending it", rid)
            yield protocol.final_chunk(rid)
            return
        try:
            greq = protocol.to_generation_request(request, rid, default_max_tokens=self.default_max_tokens)
            check_replay(self.engine, request, greq)
        except ValueError as exc:  # BadRequest, UnsupportedRequest: the reason goes back to the client
            log.warning("request %s refused: %s", rid, exc)
            raise _refusal(exc) from None
        logprobs = protocol.wants_logprobs(request)
        self._live.add(rid)
        stream = self.engine.generate(greq)
        watcher = asyncio.ensure_future(self._abort_when_stopped(context, rid)) if context is not None else None
        try:
            async for ev in stream:
                if ev.finish_reason == "abort":
                    if context is not None and (context.is_stopped() or context.is_killed()):
                        return  # the client went away; nobody reads this stream any more
                    raise RuntimeError(f"engine aborted request {rid} after {ev.index} tokens")
                yield protocol.to_chunk(ev, logprobs=logprobs)
                if ev.finish_reason is not None:
                    self.requests_served += 1
        finally:
            if watcher is not None:
                watcher.cancel()
            await stream.aclose()  # aborts the engine request if it has not finished
            self._live.discard(rid)

    async def _abort_when_stopped(self, context, rid: str) -> None:
        try:
            await context.async_killed_or_stopped()
        except asyncio.CancelledError:
            return
        log.info("request %s stopped by the frontend; aborting it", rid)
        self.engine.abort(rid)

    # ------------------------------------------------------------------------------------ admin routes

    def _weight_route(self, op: str):
        async def route(body: dict) -> dict:
            body = dict(body) if isinstance(body, dict) else body
            token = body.pop("auth", None) if isinstance(body, dict) else None
            try:
                return await asyncio.to_thread(self.control.call, op, body, token)
            except Exception as exc:
                log.warning("weights/%s failed: %s: %s", op, type(exc).__name__, exc)
                raise

        return route

    def register_admin_routes(self, runtime) -> None:
        """Register ``/engine/weights/<op>`` for every op of ``syncd.engines.wire.OPS``."""
        from syncd.engines.wire import OPS

        for op in OPS:
            runtime.register_engine_route(WEIGHT_ROUTE_PREFIX + op, self._weight_route(op))

    # ------------------------------------------------------------------------------------ lifecycle

    async def run(self, runtime) -> None:
        """Register and serve until the runtime shuts down (see the module docstring for signals)."""
        from dynamo.llm import ModelInput, ModelRuntimeConfig, ModelType, WorkerType, register_model

        self.runtime = runtime
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal)
        self.register_admin_routes(runtime)
        if self.wait_for_weights:
            await self._wait_for_weights()
        self.registered_version = self.engine.version
        self.endpoint = runtime.endpoint(self.endpoint_path)
        config = ModelRuntimeConfig()
        if self.context_length:
            config.context_length = self.context_length
        await register_model(ModelInput.Tokens, ModelType.Chat | ModelType.Completions, self.endpoint,
                             self.model_dir, self.served_name, worker_type=WorkerType.Aggregated,
                             runtime_config=config)
        runtime.set_health_status(True)
        announce = asyncio.ensure_future(self._announce())
        watch = asyncio.ensure_future(self._warn_if_unmanaged())
        try:
            await self.endpoint.serve_endpoint(self.generate, graceful_shutdown=True)
        finally:
            announce.cancel()
            watch.cancel()
        log.info("worker %s stopped after %d requests", self.endpoint_path, self.requests_served)

    async def _wait_for_weights(self, interval_s: float = 0.05) -> None:
        """Until the engine holds a version and is not paused (the daemon's rebuild resumes it at its end)."""
        if self.engine.version is None:
            log.info("holding registration until the node daemon has loaded weights (give it this worker's "
                     "admin URL)")
        while self.engine.version is None or getattr(self.engine, "paused", False):
            if self._stopping:
                return
            await asyncio.sleep(interval_s)
        log.info("engine holds version %s; registering with the frontend", self.engine.version)

    async def _warn_if_unmanaged(self) -> None:
        """WARNING when no node daemon took a lease within :data:`UNMANAGED_WARNING_S` of the registration."""
        await asyncio.sleep(UNMANAGED_WARNING_S)
        if self.control.state()["lease"] is None:
            log.warning("no node daemon has taken this worker's lease %.0f s after it registered: it serves "
                        "version %s of the folder's weights and nothing keeps them current", UNMANAGED_WARNING_S,
                        self.engine.version)

    async def _announce(self) -> None:
        """Write the ready file once this instance is visible through discovery."""
        if self.ready_file is None:
            return
        me = self.endpoint.connection_id()
        client = await self.endpoint.client()
        while me not in client.instance_ids():
            await asyncio.sleep(0.05)
        info = {"pid": os.getpid(), "instance_id": me, "endpoint": self.endpoint_path,
                "system_port": int(os.environ.get("DYN_SYSTEM_PORT") or 0) or None,
                "model": self.served_name, "version": self.registered_version}
        tmp = self.ready_file.with_name(self.ready_file.name + ".tmp")
        tmp.write_text(json.dumps(info))
        os.replace(tmp, self.ready_file)

    def _on_signal(self) -> None:
        if self._stopping:
            log.warning("second stop signal: exiting now")
            os._exit(1)
        self._stopping = True
        asyncio.ensure_future(self._shutdown())

    async def _shutdown(self) -> None:
        log.info("stopping: leaving discovery, draining %d requests for up to %.0f s", len(self._live),
                 self.drain_timeout_s)
        self.runtime.set_health_status(False)
        asyncio.get_running_loop().call_later(self.drain_timeout_s, self._drain_expired)
        self.runtime.shutdown()

    def _drain_expired(self) -> None:
        """In-flight requests did not finish in time: save their replay records and exit, so the frontend
        migrates the streams this cuts."""
        log.warning("drain timeout: exiting with %d requests in flight (the frontend migrates them)",
                    len(self._live))
        recorder = getattr(self.engine, "recorder", None)
        if recorder is not None:
            try:
                recorder.flush(timeout=10)
            except Exception as exc:  # noqa: BLE001
                log.error("replay records not flushed: %s", exc)
        logging.shutdown()
        os._exit(0)


def _refusal(exc: ValueError) -> Exception:
    """A refused request as Dynamo's ``InvalidArgument``: the frontend answers the client HTTP 400 (or, on a
    stream, an error event with code 400) with this message; any other exception reaches the client as
    "Invalid request" only."""
    from dynamo.llm.exceptions import InvalidArgument

    return InvalidArgument(str(exc))


def _context_length(model_dir) -> int | None:
    try:
        return int(json.loads(Path(model_dir, "config.json").read_text()).get("max_position_embeddings") or 0) or None
    except (OSError, ValueError):
        return None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="syncd-dynamo-worker", formatter_class=HelpFormatter,
                                description="Serve an engine as an NVIDIA Dynamo worker (python -m "
                                            "syncd.engine.dynamo.worker; syncd serve starts and supervises them).")
    p.add_argument("--model", required=True, help="model folder (config.json, tokenizer, weights)")
    p.add_argument("--served-model-name", default=None, help="OpenAI model name (default: the folder's name)")
    p.add_argument("--engine", default=os.environ.get("SYNCD_DYNAMO_ENGINE", "reference"),
                   help="reference, vllm, or MODULE:FACTORY called with the parsed arguments [SYNCD_DYNAMO_ENGINE]")
    p.add_argument("--component", default="backend", help="Dynamo component name")
    p.add_argument("--endpoint", default="generate", help="Dynamo endpoint name")
    p.add_argument("--system-port", type=int, default=None,
                   help="admin/health port (DYN_SYSTEM_PORT; 0 or unset: Dynamo's choice)")
    p.add_argument("--weights-version", type=int, default=None,
                   help="the run version the folder's weights are: register at once and serve them (a node that "
                        "starts with its run). Default: start with weights of no version and register only once "
                        "the node daemon has loaded the newest one")
    p.add_argument("--replay-store", default=None, help="store URL for replay records (needs --run-id)")
    p.add_argument("--run-id", default=os.environ.get("SYNCD_RUN_ID"), help="run id of the replay records")
    p.add_argument("--replay-kept-tolerance", type=float, default=None,
                   help="record kept sets the trainer can rebuild from its logits within this tolerance (scaled "
                        "logits; docs/replay-format.md); default: list every set")
    p.add_argument("--replay-spill-dir", default=os.environ.get("SYNCD_REPLAY_SPILL_DIR"),
                   help="keep replay records the store refuses in this folder until it takes them (a restarted "
                        "worker writes what it finds there) [SYNCD_REPLAY_SPILL_DIR]")
    p.add_argument("--max-batch", type=int, default=8, help="requests running at once")
    p.add_argument("--max-model-len", type=int, default=None, help="vLLM's max_model_len (default: the model's)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="vLLM's tensor-parallel ranks (--engine vllm)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--default-max-tokens", type=int, default=protocol.DEFAULT_MAX_TOKENS)
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds in-flight requests get on stop")
    p.add_argument("--ready-file", default=None, help="write {pid, instance_id, system_port} here when up")
    p.add_argument("--engine-token-file", default=None,
                   help="the node's engine control token, created if missing [SYNCD_ENGINE_TOKEN_FILE; "
                        "default ~/.config/syncd/engine-token]")
    p.add_argument("--log-level", default=os.environ.get("SYNCD_LOG_LEVEL", "WARNING"), help="[SYNCD_LOG_LEVEL]")
    add_arguments(p)
    return p


def main(argv=None) -> int:
    """Run one worker until SIGTERM. Exit status 0 on a clean stop, 2 on bad arguments, 1 on failure."""
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings: DynamoSettings = from_args(args)
    except ValueError as exc:
        print(f"syncd.engine.dynamo.worker: {exc}", file=sys.stderr)
        return 2
    if args.system_port is not None and not 0 <= args.system_port <= MAX_SYSTEM_PORT:
        print(f"syncd.engine.dynamo.worker: --system-port must be 0..{MAX_SYSTEM_PORT} (Dynamo 1.6 reads it as a "
              "signed 16-bit number)", file=sys.stderr)
        return 2
    taken = args.system_port and port_taken(settings.host, args.system_port)
    if taken:  # before the model loads, which takes long
        print(f"syncd.engine.dynamo.worker: --system-port {args.system_port}: cannot listen on {settings.host}:"
              f"{args.system_port} ({taken}); pick another, or 0", file=sys.stderr)
        return 2
    if args.tensor_parallel_size < 1 or (args.tensor_parallel_size > 1 and args.engine != "vllm"):
        print("syncd.engine.dynamo.worker: --tensor-parallel-size must be 1, or more with --engine vllm", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(max(1, args.threads))
    try:
        engine = build_engine(args)
    except (ValueError, TypeError, OSError, ImportError, AttributeError) as exc:
        print(f"syncd.engine.dynamo.worker: cannot build the engine: {exc}", file=sys.stderr)
        return 2
    from syncd.engine_token import load_or_create
    from syncd.signing import key_from_env

    try:
        token, key = load_or_create(args.engine_token_file), key_from_env()
    except ValueError as exc:
        print(f"syncd.engine.dynamo.worker: {exc}", file=sys.stderr)
        return 2
    settings.apply()
    if args.system_port is not None:
        os.environ["DYN_SYSTEM_PORT"] = str(args.system_port)
    worker = DynamoWorker(engine, model_dir=args.model,
                          served_name=args.served_model_name or Path(args.model).resolve().name,
                          namespace=settings.namespace, component=args.component, endpoint=args.endpoint,
                          default_max_tokens=args.default_max_tokens, drain_timeout_s=args.drain_timeout,
                          ready_file=args.ready_file, context_length=_context_length(args.model),
                          token=token, signing_key=key if key else False,
                          run_id=args.run_id if args.weights_version is not None else None)

    async def run():
        from dynamo.runtime import DistributedRuntime

        runtime = DistributedRuntime(asyncio.get_running_loop(), settings.discovery, settings.request_plane)
        await worker.run(runtime)

    import uvloop

    try:
        uvloop.run(run())
    finally:
        close = getattr(engine, "close", None)
        if close is not None:
            close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
