"""The per-sandbox OpenAI-compatible proxy in front of the Dynamo frontend.

An agent sandbox talks to ``http://proxy/v1/chat/completions`` and ``/v1/completions`` (streamed or not;
``GET /v1/models`` and ``/v1/models/<id>`` too, passed on) exactly as it would to the frontend. For every request
the proxy

* asks the frontend for a stream with the prompt's token ids (``nvext.annotations: ["token_ids"]``) and
  every chunk's ``engine_data`` (token ids, log-probabilities, weight versions and the engine's request
  id, see ``syncd.engine.dynamo.protocol``), whatever the client asked; the client gets back only what it asked
  for (a streamed or a whole response, ``nvext`` and usage only when requested);
* retries the request when the upstream fails before any token came back (connection refused, a timeout,
  HTTP 5xx/408/429, 404 while the frontend lists no model, an error event without a client-error code):
  up to ``retry_attempts`` tries within ``retry_deadline_s``; after the first token a failure cannot be hidden
  from the client and fails the turn (Dynamo's own migration is what survives a dead worker mid-stream). What
  the frontend refuses as the client's mistake (a model it does not serve, a value or option it or a worker
  refuses: HTTP 4xx, or a 4xx error event) is passed on at once with the frontend's reason, and the turn is
  recorded as failed with it (``syncd.engine.proxy.upstream``);
* records the turn: prompt and output token ids, each token's weight version and log-probability, finish
  reason, usage, the engine request ids (which link the turn to the engines' replay records) and the
  workers' segments of a migrated request; the record is checked against the frontend's usage counts.

A client body that is not strict JSON (``NaN``, ``Infinity``, nesting deeper than 64, anything the
record's strict encoder would refuse) or whose ``nvext``/``stream_options`` are malformed is refused with
a 400 before a turn exists: nothing is served or recorded for it.

Turns are grouped into trajectories by the ``X-Syncd-Trajectory`` request header (default: the proxy's
``default_trajectory``, else ``default-<life>``, unique to this proxy life; with ``per_request`` every
request is its own trajectory, written when it ends). ``POST /syncd/trajectories/<id>/finish`` (JSON body,
optional ``{"metadata": {...}}``) writes a trajectory's record to the store (``syncd.engine.proxy.record``) and
answers ``{"key", "trajectory_id", "status", "failure", "written"}``; when the proxy stops, every open
trajectory is written, each on its own. A trajectory stays open until its record is in the store or kept
for retry (and spilled to ``spill_dir``): ``syncd.engine.proxy.writer`` never overwrites, renames a record whose
key an earlier proxy life took, and reports every record it could neither write nor spill. A turn that
could not complete (upstream failure after tokens, client gone, proxy stopped) is kept with what it got and
marked failed with the reason; its trajectory is then ``failed``. A finished trajectory id that comes back is
refused (409 at finish, 400 for a request) while it is among the newest ``MAX_WRITTEN_IDS`` finished ones; an
older one opens a new trajectory, whose record the writer renames rather than overwrite.

Supervision: the retry task runs under a :class:`syncd.supervise.Supervisor`; it and any route that raises
what it did not expect are logged and counted in ``syncd_failures_total{kind}`` (``GET /metrics``; kinds
``store``, ``record``, ``task``, ``request``); ``GET /health`` shows the counts and the task's health.

``POST /syncd/trajectories/<id>/tool_calls`` (``{"tool_calls": [...]}``) appends the tool calls an agent harness
ran to an open trajectory's record (``syncd.records.trajectory``, schema version 2: each one checked, the whole
body refused with a 400 naming the bad member, 404 for an unknown trajectory, 409 for a finished one); the
harness runs the tools, the proxy only records them.

``POST /v1/responses`` (the Responses API) is passed on as the client sent it and recorded as a turn without a
token record, which the frontend does not send for it (``syncd.engine.proxy.responses``).

The per-turn bookkeeping is ``syncd.engine.proxy.turn``, the attempts at the frontend ``syncd.engine.proxy.upstream``.

Thread-safety: one asyncio loop (uvloop) runs everything; the store is called from worker threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from aiohttp import web

from syncd.engine.proxy import responses
from syncd.engine.proxy.record import RecordError, Trajectory, Turn, check_id, now
from syncd.engine.proxy.turn import (TRAJECTORY_HEADER, BadRequest, ClientStream, TurnState, check_complete,
                                     error_response, parse_body, upstream_body, whole_response)
from syncd.engine.proxy.upstream import stream_once, with_retries
from syncd.engine.proxy.writer import RecordWriter, new_life
from syncd.supervise import Failures, Supervisor
from syncd.urls import check_http_url

log = logging.getLogger(__name__)

__all__ = ["ProxyConfig", "Proxy", "TRAJECTORY_HEADER"]

MAX_REQUEST_BYTES = 64 << 20
MAX_WRITTEN_IDS = 100_000  # finished trajectory ids remembered (and refused when they come back), newest kept
FAILURE_KINDS = ("store", "record", "task", "request")


@dataclass(frozen=True)
class ProxyConfig:
    """``upstream``: the frontend's base URL. ``run_id``/``sandbox_id``: where records go. Timeouts in
    seconds: ``connect_timeout_s`` per connection, ``read_timeout_s`` between two upstream reads."""

    upstream: str
    run_id: str
    sandbox_id: str
    default_trajectory: str | None = None
    per_request: bool = False
    retry_attempts: int = 5
    retry_backoff_s: float = 0.25
    retry_deadline_s: float = 60.0
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 600.0
    write_retry_s: float = 2.0
    spill_dir: Path | None = None
    compaction: object | None = None  # an syncd.engine.proxy.compaction.CompactionConfig: self-compaction on

    def __post_init__(self):
        check_http_url(self.upstream, "upstream")
        check_id(self.run_id, "run id")
        check_id(self.sandbox_id, "sandbox id")
        if self.default_trajectory is not None:
            check_id(self.default_trajectory, "trajectory id")
        if self.retry_attempts < 1:
            raise ValueError("retry_attempts must be at least 1")


class Proxy:
    """The proxy (see the module docstring). ``store``: a :class:`syncd.store.Store` (or URL) for records."""

    def __init__(self, config: ProxyConfig, store):
        from syncd.store import Store

        self.config = config
        self.store = Store.open(store)
        self.upstream = config.upstream.rstrip("/")
        self.life = new_life()
        self.failures = Failures(FAILURE_KINDS)
        self.supervisor = Supervisor(f"proxy {config.sandbox_id}", on_failure=self.failures, logger=log)
        self.writer = RecordWriter(self.store, life=self.life, spill_dir=config.spill_dir,
                                   retry_s=config.write_retry_s, failures=self.failures)
        self.trajectories: dict[str, Trajectory] = {}
        # client's trajectory id -> key, once finished (written or pending): the newest MAX_WRITTEN_IDS only; an
        # older id that comes back opens a new trajectory, which the writer renames rather than overwrite
        self.written: OrderedDict[str, str] = OrderedDict()
        self._finishing: dict[str, asyncio.Future] = {}  # trajectory id -> its write, while in progress
        self._running: dict[str, list[TurnState]] = {}
        self._background: set[asyncio.Task] = set()  # per-request finishes
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self._closing = False
        self.url: str | None = None
        self.compactor = None
        if config.compaction is not None:
            from syncd.engine.proxy.compaction import Compactor

            self.compactor = Compactor(config.compaction, registry=self.failures.registry)

    # ------------------------------------------------------------------------------------ lifecycle

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_REQUEST_BYTES, middlewares=[self._unexpected])
        for endpoint in ("chat/completions", "completions", responses.ENDPOINT):
            app.router.add_post(f"/v1/{endpoint}", self._turn_route(endpoint))
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/models/{model:.+}", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/syncd/trajectories/{tid}/finish", self._finish_route)
        app.router.add_get("/syncd/trajectories/{tid}", self._show_route)
        app.router.add_post("/syncd/trajectories/{tid}/tool_calls", self._tool_calls_route)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve on ``host:port`` (0: a free port); returns the base URL."""
        timeout = aiohttp.ClientTimeout(total=None, connect=self.config.connect_timeout_s,
                                        sock_read=self.config.read_timeout_s)
        self._session = aiohttp.ClientSession(timeout=timeout)
        self._runner = web.AppRunner(self.app(), access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://{host}:{port}"
        self.supervisor.spawn("record retry", self.writer.retry_loop)
        log.info("proxy for sandbox %s serving at %s -> %s", self.config.sandbox_id, self.url, self.upstream)
        return self.url

    async def close(self, timeout_s: float = 30.0) -> None:
        """Stop serving, write every open trajectory (each on its own: one that fails never stops the
        others), retry unwritten records until ``timeout_s``, and report what is left (spilled or lost)."""
        self._closing = True
        deadline = time.monotonic() + timeout_s
        if self._runner is not None:
            try:
                await self._runner.cleanup()  # cancels running handlers: their turns are marked failed
            except Exception as exc:  # noqa: BLE001 -- the records matter more than a clean shutdown
                self.supervisor.failed("http server shutdown", exc)
            self._runner = None
        for tid in list(self.trajectories):
            try:
                await self.finish(tid)
            except Exception as exc:  # noqa: BLE001 -- reported; the next trajectory is written all the same
                self._unwritable(tid, exc)
        if self._finishing or self._background:
            await asyncio.gather(*self._finishing.values(), *self._background, return_exceptions=True)
        await self.supervisor.stop()
        await self.writer.drain(deadline)
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _unwritable(self, tid: str, exc: BaseException) -> None:
        """A trajectory whose record cannot be made at all (a bug): logged with what it holds, counted."""
        traj = self.trajectories.get(tid)
        log.error("trajectory %s (%d turns, key %s) could not be written and is lost: %s: %s", tid,
                  len(traj.turns) if traj else 0, traj.key if traj else "?", type(exc).__name__, exc)
        self.failures("record")

    # ------------------------------------------------------------------------------------ trajectories

    def _trajectory_id(self, request: web.Request) -> str:
        tid = request.headers.get(TRAJECTORY_HEADER)
        if tid is None:
            tid = (f"req-{uuid.uuid4().hex}" if self.config.per_request
                   else self.config.default_trajectory or f"default-{self.life}")
        return check_id(tid, f"{TRAJECTORY_HEADER} header")

    def _open(self, tid: str) -> Trajectory:
        if tid in self.written:
            raise RecordError(f"trajectory {tid} is already finished and written")
        if tid in self._finishing:
            raise RecordError(f"trajectory {tid} is being finished")
        traj = self.trajectories.get(tid)
        if traj is None:
            traj = self.trajectories[tid] = Trajectory(self.config.run_id, self.config.sandbox_id, tid)
        return traj

    async def finish(self, tid: str, metadata: dict | None = None, *, wait_s: float = 60.0) -> dict:
        """Write trajectory ``tid`` (after its running turns end, at most ``wait_s``; turns still running
        then are marked failed). Returns ``{"key", "trajectory_id", "status", "failure", "written"}``
        (``written``: in the store; else kept for retry and spilled). The trajectory stays open, unchanged,
        if ``metadata`` cannot be recorded (:class:`BadRequest`); a second call while the write is in
        progress gets the same answer. Raises ``KeyError`` (unknown), :class:`RecordError` (finished)."""
        if tid in self._finishing:
            return await asyncio.shield(self._finishing[tid])
        traj = self.trajectories.get(tid)
        if traj is None:
            if tid in self.written:
                raise RecordError(f"trajectory {tid} is already finished and written")
            raise KeyError(f"no trajectory {tid!r} in this proxy")
        if metadata:
            try:
                json.dumps(metadata, allow_nan=False)
            except (ValueError, TypeError, RecursionError) as exc:
                raise BadRequest(f"metadata of trajectory {tid} cannot be recorded: {exc}") from None
        running = [s.done.wait() for s in self._running.get(tid, [])]
        if running:
            try:
                await asyncio.wait_for(asyncio.gather(*running), wait_s)
            except asyncio.TimeoutError:
                pass
        if tid in self._finishing:  # another finish started while this one waited
            return await asyncio.shield(self._finishing[tid])
        for t in traj.turns:
            if t.status == "running":
                t.fail("the trajectory was finished while this request was still running")
        traj.metadata.update(metadata or {})
        traj.finished_at = now()
        done = self._finishing[tid] = asyncio.ensure_future(self._write(tid, traj))
        return await asyncio.shield(done)  # a cancelled caller does not cancel the write

    async def _write(self, tid: str, traj: Trajectory) -> dict:
        try:
            written = await self.writer.write(traj)
        except BaseException:
            self._finishing.pop(tid, None)  # not encodable: it stays open (and close() reports it)
            traj.finished_at = None
            raise
        finally:
            if self.compactor is not None:
                self.compactor.forget(tid)  # written, or it failed: a later request starts from its own prompt
        self.written[tid] = traj.key
        while len(self.written) > MAX_WRITTEN_IDS:
            self.written.popitem(last=False)
        self.trajectories.pop(tid, None)  # only now: written, or pending (and spilled)
        self._finishing.pop(tid, None)
        log.info("trajectory %s: %s, %d turns, %s", tid, traj.status, len(traj.turns),
                 f"written to {traj.key}" if written else "store write pending")
        return {"key": traj.key, "trajectory_id": traj.trajectory_id, "status": traj.status,
                "failure": traj.failure, "written": written}

    @property
    def pending_writes(self) -> int:
        return len(self.writer.pending)

    @contextlib.asynccontextmanager
    async def running_turn(self, tid: str, traj: Trajectory, turn: Turn, what: str = ""):
        """Append ``turn`` to ``traj`` and track it as running (:meth:`finish` waits for it) while the body runs;
        yields its :class:`TurnState`. A cancelled body marks the turn failed (the proxy stopped, or the client
        went away after N tokens ``what``), so does one that left it running."""
        traj.turns.append(turn)
        state = TurnState(turn)
        running = self._running.setdefault(tid, [])
        running.append(state)
        try:
            yield state
        except asyncio.CancelledError:
            turn.fail("the proxy stopped while this request was running" if self._closing
                      else f"the client went away after {state.tokens} tokens{what}")
            raise
        finally:
            if turn.status == "running":
                turn.fail("the proxy stopped while this request was running")
            state.done.set()
            running.remove(state)
            if not running and self._running.get(tid) is running:
                del self._running[tid]

    # ------------------------------------------------------------------------------------ routes

    @web.middleware
    async def _unexpected(self, request: web.Request, handler):
        """A route that raises what it did not expect answers 500 and is logged and counted."""
        try:
            return await handler(request)
        except (web.HTTPException, asyncio.CancelledError):
            raise
        except Exception as exc:  # noqa: BLE001 -- reported; the proxy goes on
            self.supervisor.failed(f"{request.method} {request.path}", exc, kind="request")
            return error_response(500, f"proxy error: {type(exc).__name__}: {exc}", "internal_error")

    async def _health(self, request: web.Request) -> web.Response:
        health = {"ok": True, "life": self.life, "open_trajectories": len(self.trajectories),
                  "pending_writes": len(self.writer.pending), "failures": self.failures.totals,
                  "tasks": self.supervisor.health()}
        if self.compactor is not None:
            health["compactions"] = self.compactor.stats()
        return web.json_response(health)

    async def _metrics(self, request: web.Request) -> web.Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return web.Response(body=self.failures.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _models(self, request: web.Request) -> web.Response:
        """``GET /v1/models`` and ``/v1/models/<id>``: the frontend's answer, passed on (not a turn)."""
        try:
            async with self._session.get(self.upstream + request.raw_path) as resp:
                return web.Response(status=resp.status, body=await resp.read(), content_type="application/json")
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return error_response(502, f"upstream {self.upstream} unreachable: {type(exc).__name__}: {exc}",
                                  "upstream_unavailable")

    def _turn_route(self, endpoint: str):
        async def route(request: web.Request) -> web.StreamResponse:
            return await self._completion(request, endpoint)
        return route

    async def _finish_route(self, request: web.Request) -> web.Response:
        tid = request.match_info["tid"]
        try:
            body = parse_body(await request.read(), max_bytes=MAX_REQUEST_BYTES, what="finish body") \
                if request.can_read_body else {}
            meta = body.get("metadata")
            if meta is not None and not isinstance(meta, dict):
                return error_response(400, "'metadata' must be a JSON object", "invalid_request_error")
            return web.json_response(await self.finish(tid, meta))
        except KeyError as exc:
            return error_response(404, str(exc.args[0]), "not_found")
        except BadRequest as exc:
            return error_response(400, str(exc), "invalid_request_error")
        except RecordError as exc:
            return error_response(409, str(exc), "conflict")

    async def _tool_calls_route(self, request: web.Request) -> web.Response:
        tid = request.match_info["tid"]
        try:
            body = parse_body(await request.read(), max_bytes=MAX_REQUEST_BYTES, what="tool calls body")
        except BadRequest as exc:
            return error_response(400, str(exc), "invalid_request_error")
        traj = self.trajectories.get(tid)
        if traj is None or tid in self._finishing:
            gone = tid in self.written or tid in self._finishing
            return error_response(409 if gone else 404, f"no open trajectory {tid!r}", "conflict" if gone else "not_found")
        try:
            traj.add_tool_calls(body.get("tool_calls"))
        except RecordError as exc:
            return error_response(400, str(exc), "invalid_request_error")
        return web.json_response({"trajectory_id": tid, "tool_calls": len(traj.tool_calls)})

    async def _show_route(self, request: web.Request) -> web.Response:
        traj = self.trajectories.get(request.match_info["tid"])
        if traj is None:
            return error_response(404, f"no open trajectory {request.match_info['tid']!r}", "not_found")
        return web.json_response(traj.to_json())

    # ------------------------------------------------------------------------------------ completions

    async def _completion(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        try:
            body = parse_body(await request.read(), max_bytes=MAX_REQUEST_BYTES)
        except BadRequest as exc:
            return error_response(400, str(exc), "invalid_request_error")
        try:
            tid = self._trajectory_id(request)
            traj = self._open(tid)
        except RecordError as exc:
            return error_response(400, str(exc), "invalid_request_error")
        plan = self.compactor.plan(tid, body, endpoint) if self.compactor is not None else None
        if plan is not None:
            try:
                return await self.compactor.run(self, plan, traj, tid, body, request)
            finally:
                self._request_ended(tid)
        turn = Turn(index=len(traj.turns), endpoint=endpoint, request=body, stream=bool(body.get("stream")))
        try:
            async with self.running_turn(tid, traj, turn) as state:
                return await self._run_turn(state, body, endpoint, ClientStream(request, turn, tid))
        finally:
            self._request_ended(tid)

    def _request_ended(self, tid: str) -> None:
        """With ``per_request``, a request's trajectory is written once the request ends."""
        if self.config.per_request and tid in self.trajectories and not self._closing:
            task = asyncio.ensure_future(self._finish_logged(tid))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _finish_logged(self, tid: str) -> None:
        try:
            await self.finish(tid)
        except Exception as exc:  # noqa: BLE001 -- a background write; nothing else can report it
            self.supervisor.failed(f"finish {tid}", exc, kind="record")

    async def _run_turn(self, state: TurnState, body: dict, endpoint: str, out: ClientStream):
        turn = state.turn
        if endpoint == responses.ENDPOINT:  # passed on as the client sent it (no token record to ask for)
            return await self.attempts(state, body, endpoint, out) or await responses.finish(state, out)
        failed = await self.attempts(state, upstream_body(body), endpoint, out)
        if failed is not None:
            return failed
        check_complete(state)
        if turn.status == "failed":
            return await out.fail(turn.error)
        turn.status, turn.finished_at = "ok", now()
        if turn.stream:
            return await out.end()
        return web.json_response(whole_response(state, endpoint), headers=out.headers)

    async def attempts(self, state: TurnState, up_body: dict, endpoint: str, out: ClientStream):
        """The turn's attempts at the frontend with their retries (``syncd.engine.proxy.upstream.with_retries``):
        None when one streamed the turn to its end, else the response that tells the client why not."""
        once = responses.respond_once if endpoint == responses.ENDPOINT else stream_once
        return await with_retries(once, self._session, self.upstream, self.config, state, up_body, endpoint, out)
