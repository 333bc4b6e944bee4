"""The HTTP server of a standalone engine process (``python -m syncd.engine.control_server --model DIR --port
P``), on aiohttp (the proxy's HTTP stack): the control routes (:mod:`syncd.engines.wire`) through an
:class:`~syncd.engines.control.EngineControl`, and, when the engine serves generation, ``POST /generate``
(newline-delimited JSON token events) and ``GET /health``.

Hostile local clients cost little: an idle or slow connection (no request, or headers trickling in) is
closed after ``read_timeout_s``; a body must arrive within ``read_timeout_s`` too; a ``Content-Length``
that is negative or over the limit is refused at once (400/413) without reading anything; the weight
routes check the engine token *before* reading the body (401); at most ``max_control`` control requests
run at once (more get 503 at once). Nothing holds a thread per connection: the server runs one event loop
in one thread, weight ops run in worker threads.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING

from aiohttp import web

from syncd import jsonsafe
from syncd.engines.control import EngineControl
from syncd.engines.errors import BadRequest
from syncd.engines.wire import MAX_BODY_BYTES, ROUTE_PREFIX, error_reply

if TYPE_CHECKING:  # imported where used: the engine contract imports torch, and `--help` must not wait for it
    from syncd.engines.protocol import GenerationRequest

log = logging.getLogger(__name__)

__all__ = ["ControlServer", "main"]

MAX_GENERATE_BODY_BYTES = 4 << 20


def _request_from_json(d: dict) -> GenerationRequest:
    from syncd.engines.protocol import GenerationRequest, SamplingParams

    try:
        sp = SamplingParams(max_tokens=int(d.get("max_tokens", 16)), temperature=float(d.get("temperature", 1.0)),
                            top_p=float(d.get("top_p", 1.0)), top_k=int(d.get("top_k", 0)),
                            seed=None if d.get("seed") is None else int(d["seed"]),
                            stop_token_ids=tuple(int(t) for t in d.get("stop_token_ids", ())))
        return GenerationRequest(str(d["request_id"]), tuple(int(t) for t in d["prompt_token_ids"]), sp)
    except (KeyError, TypeError, ValueError) as exc:
        raise BadRequest(f"malformed generation request: {exc!r}") from None


def _error(exc: BaseException) -> web.Response:
    status, body = error_reply(exc)
    return web.json_response(body, status=status)


class ControlServer:
    """An engine's HTTP server (see the module docstring). ``control``: the :class:`EngineControl` (or pass
    ``adapter``, and ``token``, else the node's token file, :func:`syncd.engine_token.load_or_create`). ``generator``: serve generation too. ``port=0`` picks a free
    port (see :attr:`port`). :meth:`start` runs it in a daemon thread; :meth:`close` stops it."""

    def __init__(self, adapter=None, generator=None, *, token: str | None = None, control: EngineControl | None = None,
                 host: str = "127.0.0.1", port: int = 0, read_timeout_s: float = 10.0, max_control: int = 8,
                 signing_key=None):
        if control is None:
            from syncd.engine_token import load_or_create

            control = EngineControl(adapter, token=token or load_or_create(), signing_key=signing_key)
        self.control, self.generator = control, generator
        self.host, self.port = host, port
        self.read_timeout_s, self.max_control = read_timeout_s, max_control
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._busy = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # ------------------------------------------------------------------------------------- routes

    async def _body(self, request: web.Request, limit: int):
        n = request.content_length
        if n is not None and n > limit:
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=n)
        try:
            raw = await asyncio.wait_for(request.read(), self.read_timeout_s)
        except asyncio.TimeoutError:
            raise web.HTTPRequestTimeout(text=f"request body not received within {self.read_timeout_s:g}s") from None
        if len(raw) > limit:
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=len(raw))
        if not raw:
            return {}
        body = jsonsafe.loads(raw, what="request body", max_bytes=limit, max_depth=8, error=BadRequest)
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        return body

    async def _weights(self, request: web.Request) -> web.StreamResponse:
        op = request.match_info["op"]
        auth = request.headers.get("Authorization", "")
        try:
            self.control.check_token(auth[7:] if auth.startswith("Bearer ") else None)
        except Exception as exc:  # noqa: BLE001 -- refused before the body is read
            return _error(exc)
        if self._busy >= self.max_control:
            return web.json_response({"error": f"{self._busy} control requests already running", "type": "Busy"},
                                     status=503)
        self._busy += 1
        try:
            body = await self._body(request, MAX_BODY_BYTES)
            if isinstance(body, dict):
                body.pop("auth", None)
            reply = await asyncio.to_thread(self.control.call, op, body, auth[7:])
            return web.json_response(reply)
        except web.HTTPException:
            raise
        except Exception as exc:  # noqa: BLE001 -- every failure becomes an error reply
            if not isinstance(exc, (KeyError, BadRequest)):
                log.warning("engine route %s failed: %s: %s", op, type(exc).__name__, exc)
            return _error(exc)
        finally:
            self._busy -= 1

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "version": self.control.adapter.version, "pid": os.getpid()})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        try:
            greq = _request_from_json(await self._body(request, MAX_GENERATE_BODY_BYTES))
        except BadRequest as exc:
            return _error(exc)
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        try:
            async for ev in self.generator.generate(greq):
                line = {"request_id": ev.request_id, "index": ev.index, "token_id": ev.token_id,
                        "logprob": ev.logprob, "version": ev.version, "finish_reason": ev.finish_reason}
                await resp.write(json.dumps(line).encode() + b"\n")
        except (ConnectionError, asyncio.CancelledError):
            self.generator.abort(greq.request_id)  # the client went away
            raise
        await resp.write_eof()
        return resp

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_post(ROUTE_PREFIX + "{op}", self._weights)
        if self.generator is not None:
            app.router.add_post("/generate", self._generate)
            app.router.add_get("/health", self._health)
        return app

    # ------------------------------------------------------------------------------------- lifecycle

    def start(self) -> "ControlServer":
        """Serve in a daemon thread; returns once listening (raises ``OSError`` if the port is taken)."""
        ready: dict = {}
        started = threading.Event()

        async def up():
            self._runner = web.AppRunner(self.app(), access_log=None, handler_cancellation=True,
                                         keepalive_timeout=self.read_timeout_s)
            await self._runner.setup()
            site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
            await site.start()
            self.port = self._runner.addresses[0][1]

        def serve():
            loop = self._loop = asyncio.new_event_loop()
            try:
                loop.run_until_complete(up())
            except BaseException as exc:  # noqa: BLE001 -- handed to start()
                ready["error"] = exc
                started.set()
                return
            started.set()
            loop.run_forever()
            loop.run_until_complete(self._runner.cleanup())
            loop.close()

        self._thread = threading.Thread(target=serve, name="engine-control", daemon=True)
        self._thread.start()
        started.wait()
        if "error" in ready:
            raise ready["error"]
        return self

    def close(self) -> None:
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)


# ---------------------------------------------------------------------------------------------- process


def _build_engine(args):
    """The engine a standalone process serves, holding the model folder's weights as version None (they
    are no version of any run; the daemon rebuilds them): the reference engine, or with ``--headless`` the
    weights-only ``syncd.engine.StateDictEngine``. Returns ``(adapter, generator or None)``."""
    from syncd.engine.reference.model import load_folder_weights

    if args.headless:
        from syncd.engine.state_dict import StateDictEngine

        return StateDictEngine(load_folder_weights(args.model), None), None
    from syncd.engine.reference import ReferenceEngine

    eng = ReferenceEngine.from_pretrained(args.model, version=None, max_batch=args.max_batch)
    return eng, eng


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m syncd.engine.control_server", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Serve one engine process: the weight-control routes the syncd daemon drives "
                    "(POST /engine/weights/<op>, docs/engine.md) and, unless --headless, generation.",
        epilog="POST /generate takes a JSON object: request_id (string, required), prompt_token_ids (list of "
               "ints, required), max_tokens (16), temperature (1.0), top_p (1.0), top_k (0: off), seed (none), "
               "stop_token_ids ([]); it answers one JSON line per token: request_id, index, token_id, logprob, "
               "version (the weights that produced it), finish_reason (null, 'stop' or 'length'). GET /health: "
               "ok, version, pid.")
    p.add_argument("--model", required=True, help="model directory (config.json + safetensors)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    p.add_argument("--port", type=int, default=0, help="port (0: a free one, written to --ready-file)")
    p.add_argument("--ready-file", default=None, help="write {'url', 'pid'} here once serving")
    p.add_argument("--headless", action="store_true", help="weights only (syncd.engine.StateDictEngine), no generation")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--max-batch", type=int, default=8, help="requests running at once (reference engine)")
    p.add_argument("--engine-token-file", default=None,
                   help="the node's engine control token, created if missing [SYNCD_ENGINE_TOKEN_FILE; "
                        "default ~/.config/syncd/engine-token]")
    p.add_argument("--read-timeout", type=float, default=10.0,
                   help="seconds a connection may idle or take to send a request")
    p.add_argument("--log-level", default=os.environ.get("SYNCD_LOG_LEVEL", "WARNING"),
                   help="logging level [SYNCD_LOG_LEVEL]")
    return p


def main(argv=None) -> int:
    """Serve one engine process until SIGTERM/SIGINT. Exit status 0, or 2 on a configuration error."""
    args = build_parser().parse_args(argv)  # first: --help and usage errors answer at once, before torch loads
    import torch

    from syncd.engine_token import load_or_create
    from syncd.procs import port_taken
    from syncd.signing import key_from_env

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        token, key = load_or_create(args.engine_token_file), key_from_env()
    except ValueError as exc:
        print(f"syncd.engine.control_server: {exc}", file=sys.stderr)
        return 2
    taken = port_taken(args.host, args.port)  # named now, not after the model has loaded
    if taken:
        print(f"syncd.engine.control_server: --port {args.port} on {args.host} cannot be used: {taken}",
              file=sys.stderr)
        return 2
    torch.set_num_threads(max(1, args.threads))
    adapter, generator = _build_engine(args)
    server = ControlServer(control=EngineControl(adapter, token=token, signing_key=key if key else False),
                           generator=generator, host=args.host, port=args.port,
                           read_timeout_s=args.read_timeout).start()
    log.info("engine serving at %s (signatures %s)", server.url, "verified here" if key else "not checked here")
    if args.ready_file:
        tmp = args.ready_file + ".tmp"
        with open(tmp, "w") as fh:
            json.dump({"url": server.url, "pid": os.getpid(), "instance": server.control.instance}, fh)
        os.replace(tmp, args.ready_file)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.close()
    if hasattr(adapter, "close"):
        adapter.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
