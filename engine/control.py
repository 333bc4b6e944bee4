"""Out-of-process engine control: the ``POST /engine/weights/<op>`` routes, a loopback HTTP server for a
standalone engine process, and :class:`RemoteAdapter`, an ``engine.Adapter`` that drives such a process.

Routes (JSON body, JSON reply; errors reply 4xx/5xx with ``{"error": message, "type": class name}``)::

    parameters                                   -> {"parameters": [spec, ...]}
    stage      {"manifest": text, "cache_root"}  -> {"version": V}   update built from the node's shard cache
    pause                                        -> {}
    apply                                        -> {"version": V}
    rollback                                     -> {"version": V}
    load_full  {"manifest": text, "cache_root"}  -> {"version": V}   a full version, while paused
    resume                                       -> {}
    version                                      -> {"version": V or null}
    checksum   {"names": [...] or null}          -> {"checksums": {local name: "16 hex digits"}}

``handle(adapter, op, body)`` turns one route into Adapter calls (the Dynamo worker reuses it for its admin
routes). The standalone process (``python -m engine.control --model DIR --port P``) also serves the
engine's generation: ``POST /generate`` streams newline-delimited JSON token events, ``GET /health``.

Status codes: 404 unknown op, 400 malformed body, 422 bad data (``ValueError`` and its subclasses such as
``DeltaError``/``IntegrityError``, or a shard missing from the cache), 409 an op in the wrong state
(``RuntimeError``), 500 anything else. Weight ops are serialized by the server (the Adapter contract allows
one controller at a time); generation runs concurrently on other threads.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import logging
import os
import re
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Sequence
from urllib.parse import urlsplit

import torch

from engine.adapter import GenerationRequest, ParamPiece, ParamSpec, SamplingParams, Update

log = logging.getLogger(__name__)

__all__ = ["OPS", "handle", "spec_to_json", "spec_from_json", "ControlServer", "RemoteAdapter",
           "RemoteEngineError", "EngineUnreachable", "BadRequest", "stage_from_cache", "load_full_from_cache",
           "main"]

OPS = ("parameters", "stage", "pause", "apply", "rollback", "load_full", "resume", "version", "checksum")
ROUTE_PREFIX = "/engine/weights/"
MAX_BODY_BYTES = 256 << 20


class BadRequest(ValueError):
    """A control request whose body is malformed (missing or mistyped member)."""


class RemoteEngineError(RuntimeError):
    """An engine process replied with an error of a type this side does not know; the message has it."""


class EngineUnreachable(ConnectionError):
    """The engine process did not answer (down, restarting, or not listening on that address)."""


# ---------------------------------------------------------------------------------------------- handlers


def spec_to_json(spec: ParamSpec) -> dict:
    return {"name": spec.name, "dtype": str(spec.dtype).removeprefix("torch."), "shape": list(spec.shape),
            "device": str(spec.device),
            "pieces": [{"source": p.source, "source_shape": list(p.source_shape), "dim": p.dim,
                        "start": p.start, "stop": p.stop, "local_start": p.local_start} for p in spec.pieces]}


def spec_from_json(d: dict) -> ParamSpec:
    try:
        return ParamSpec(d["name"], getattr(torch, d["dtype"]), tuple(d["shape"]), d["device"],
                         tuple(ParamPiece(p["source"], tuple(p["source_shape"]), p["dim"], p["start"], p["stop"],
                                          p["local_start"]) for p in d["pieces"]))
    except (KeyError, TypeError, AttributeError) as exc:
        raise BadRequest(f"malformed parameter spec: {exc!r}") from None


def _manifest_and_root(body: dict) -> tuple[bytes, str]:
    text, root = body.get("manifest"), body.get("cache_root")
    if not isinstance(text, str) or not isinstance(root, str) or not root:
        raise BadRequest("body needs 'manifest' (the manifest's JSON text) and 'cache_root' (a path)")
    try:
        return text.encode("ascii"), root
    except UnicodeEncodeError:
        raise BadRequest("manifest text is not ASCII (manifests are canonical ASCII JSON)") from None


def handle(adapter, op: str, body: dict | None = None) -> dict:
    """Run control route ``op`` on ``adapter`` with the JSON ``body``; returns the JSON reply.

    Raises ``KeyError`` for an unknown op, :class:`BadRequest` for a malformed body, and whatever the
    adapter raises (the server maps exceptions to status codes, see the module docstring). Not
    thread-safe for weight ops: callers serialize them (one controller at a time)."""
    from syncd.cache import update_from_cache

    body = body or {}
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if op == "parameters":
        return {"parameters": [spec_to_json(s) for s in adapter.parameters()]}
    if op in ("stage", "load_full"):
        raw, root = _manifest_and_root(body)
        update = update_from_cache(raw, root)
        if op == "stage":
            adapter.stage(update)
        else:
            if update.kind != "full":
                raise ValueError(f"load_full needs a full version; version {update.version} is a delta")
            adapter.load_full(update)
        return {"version": update.version}
    if op == "pause":
        adapter.pause()
        return {}
    if op == "apply":
        adapter.apply()
        return {"version": adapter.version}
    if op == "rollback":
        adapter.rollback()
        return {"version": adapter.version}
    if op == "resume":
        adapter.resume()
        return {}
    if op == "version":
        return {"version": adapter.version}
    if op == "checksum":
        names = body.get("names")
        if names is not None and (not isinstance(names, list) or not all(isinstance(n, str) for n in names)):
            raise BadRequest("'names' must be a list of strings or null")
        return {"checksums": {k: f"{v:016x}" for k, v in adapter.checksum(names).items()}}
    raise KeyError(f"unknown engine op {op!r} (one of {', '.join(OPS)})")


def status_of(exc: BaseException) -> int:
    if isinstance(exc, KeyError):
        return 404
    if isinstance(exc, BadRequest):
        return 400
    if isinstance(exc, (ValueError, FileNotFoundError)):
        return 422
    if isinstance(exc, RuntimeError):
        return 409
    return 500


def stage_from_cache(adapter, manifest_raw: bytes, cache_root) -> None:
    """Stage a version whose shards are in the node cache: over the wire for a :class:`RemoteAdapter`,
    else by building the ``Update`` here (:func:`syncd.cache.update_from_cache`)."""
    if isinstance(adapter, RemoteAdapter):
        adapter.stage_from_cache(manifest_raw, cache_root)
    else:
        from syncd.cache import update_from_cache

        adapter.stage(update_from_cache(manifest_raw, cache_root))


def load_full_from_cache(adapter, manifest_raw: bytes, cache_root) -> None:
    """``load_full`` of a full version whose shards are in the node cache (see :func:`stage_from_cache`)."""
    if isinstance(adapter, RemoteAdapter):
        adapter.load_full_from_cache(manifest_raw, cache_root)
    else:
        from syncd.cache import update_from_cache

        adapter.load_full(update_from_cache(manifest_raw, cache_root))


# ---------------------------------------------------------------------------------------------- server


def _request_from_json(d: dict) -> GenerationRequest:
    try:
        sp = SamplingParams(max_tokens=int(d.get("max_tokens", 16)), temperature=float(d.get("temperature", 1.0)),
                            top_p=float(d.get("top_p", 1.0)), top_k=int(d.get("top_k", 0)),
                            seed=None if d.get("seed") is None else int(d["seed"]),
                            stop_token_ids=tuple(int(t) for t in d.get("stop_token_ids", ())))
        return GenerationRequest(str(d["request_id"]), tuple(int(t) for t in d["prompt_token_ids"]), sp)
    except (KeyError, TypeError, ValueError) as exc:
        raise BadRequest(f"malformed generation request: {exc!r}") from None


class ControlServer:
    """A loopback HTTP server for one engine: the weight routes over ``adapter`` and, when ``generator``
    is given, ``POST /generate`` (NDJSON token events) and ``GET /health``. Runs in daemon threads
    (:meth:`start`); :meth:`close` stops it. ``port=0`` picks a free port (see :attr:`port`)."""

    def __init__(self, adapter, generator=None, *, host: str = "127.0.0.1", port: int = 0):
        self.adapter, self.generator = adapter, generator
        self._weights_lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, fmt, *args):  # route access lines to logging, not stderr
                log.debug("%s " + fmt, self.address_string(), *args)

            def _reply(self, status: int, obj: dict) -> None:
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _body(self) -> dict:
                n = int(self.headers.get("Content-Length") or 0)
                if n > MAX_BODY_BYTES:
                    raise BadRequest(f"request body of {n} bytes is over the {MAX_BODY_BYTES}-byte limit")
                raw = self.rfile.read(n) if n else b"{}"
                try:
                    return json.loads(raw)
                except ValueError as exc:
                    raise BadRequest(f"request body is not JSON: {exc}") from None

            def do_GET(self):
                if self.path == "/health":
                    self._reply(200, {"ok": True, "version": outer.adapter.version, "pid": os.getpid()})
                else:
                    self._reply(404, {"error": f"no route GET {self.path}", "type": "KeyError"})

            def do_POST(self):
                try:
                    if self.path.startswith(ROUTE_PREFIX):
                        op = self.path[len(ROUTE_PREFIX):]
                        body = self._body()
                        with outer._weights_lock:
                            reply = handle(outer.adapter, op, body)
                        self._reply(200, reply)
                    elif self.path == "/generate" and outer.generator is not None:
                        self._generate(_request_from_json(self._body()))
                    else:
                        raise KeyError(f"no route POST {self.path}")
                except BrokenPipeError:
                    pass
                except Exception as exc:  # noqa: BLE001 -- every failure becomes an error reply
                    if not isinstance(exc, (KeyError, BadRequest)):
                        log.warning("engine route %s failed: %s: %s", self.path, type(exc).__name__, exc)
                    msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
                    try:
                        self._reply(status_of(exc), {"error": str(msg), "type": type(exc).__name__})
                    except OSError:
                        pass

            def _generate(self, request: GenerationRequest) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/x-ndjson")
                self.end_headers()

                async def stream():
                    async for ev in outer.generator.generate(request):
                        line = {"request_id": ev.request_id, "index": ev.index, "token_id": ev.token_id,
                                "logprob": ev.logprob, "version": ev.version, "finish_reason": ev.finish_reason}
                        self.wfile.write(json.dumps(line).encode() + b"\n")
                        self.wfile.flush()

                try:
                    asyncio.run(stream())
                except (BrokenPipeError, ConnectionResetError):
                    outer.generator.abort(request.request_id)  # the client went away

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            allow_reuse_address = True

        self.httpd = Server((host, port), Handler)
        self.host, self.port = self.httpd.server_address[:2]
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "ControlServer":
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="engine-control", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


# ---------------------------------------------------------------------------------------------- client


_KNOWN_ERRORS = {c.__name__: c for c in (ValueError, RuntimeError, KeyError, TypeError, FileNotFoundError)}


# How Dynamo 1.6's system server reports an exception raised by an engine route (it cannot set the status).
_DYNAMO_ROUTE_ERROR = re.compile(r"^Python callback failed: (\w+): (.*)\Z", re.DOTALL)


def _error_class(name: str):
    from syncd import errors

    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        return cls
    return _KNOWN_ERRORS.get(name, RemoteEngineError)


class RemoteAdapter:
    """``engine.Adapter`` over an engine process's control routes at ``base_url`` (``http://host:port``;
    a Dynamo worker's system port works too).

    Errors come back as the engine raised them where the type is known (``DeltaError``, ``ValueError``,
    ``RuntimeError``, ...), else as :class:`RemoteEngineError`; an engine that does not answer raises
    :class:`EngineUnreachable`. ``stage``/``load_full`` of an in-memory ``Update`` cannot cross the wire:
    use :meth:`stage_from_cache` / :meth:`load_full_from_cache` (the engine reads the node's shard cache).
    Thread-safe (a connection per call); the Adapter's one-controller rule still applies.
    """

    def __init__(self, base_url: str, *, timeout_s: float = 600.0, connect_timeout_s: float = 5.0):
        u = urlsplit(base_url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"engine control URL must be http://host:port, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.host, self.port = u.hostname, u.port or 80
        self.prefix = u.path.rstrip("/")
        self.timeout_s, self.connect_timeout_s = timeout_s, connect_timeout_s

    def __repr__(self) -> str:
        return f"RemoteAdapter({self.base_url!r})"

    def call(self, op: str, body: dict | None = None, *, timeout_s: float | None = None) -> dict:
        """POST one control route and return its JSON reply (raises as described in the class docstring)."""
        data = json.dumps(body or {}).encode()
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.connect_timeout_s)
        try:
            try:
                conn.connect()
            except OSError as exc:
                raise EngineUnreachable(f"engine at {self.base_url} is not answering: {exc}") from None
            conn.sock.settimeout(timeout_s or self.timeout_s)
            try:
                conn.request("POST", f"{self.prefix}{ROUTE_PREFIX}{op}", body=data,
                             headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                raw = resp.read()
            except (ConnectionError, http.client.HTTPException) as exc:
                raise EngineUnreachable(f"engine at {self.base_url} dropped the {op} call: {exc}") from None
        finally:
            conn.close()
        try:
            reply = json.loads(raw) if raw else {}
        except ValueError:
            raise RemoteEngineError(f"engine at {self.base_url}: {op} replied {resp.status} with non-JSON "
                                    f"{raw[:200]!r}") from None
        if resp.status != 200:
            msg = reply.get("error", f"HTTP {resp.status}") if isinstance(reply, dict) else str(reply)
            kind = reply.get("type", "") if isinstance(reply, dict) else ""
            if not kind and isinstance(reply, dict):  # Dynamo's system server: its own envelope, status 500
                m = _DYNAMO_ROUTE_ERROR.match(str(reply.get("message", "")))
                if m:
                    kind, msg = m.group(1), m.group(2)
            raise _error_class(kind)(f"engine at {self.base_url}: {op}: {msg}")
        return reply

    @property
    def version(self) -> int | None:
        return self.call("version", timeout_s=30)["version"]

    def parameters(self) -> Sequence[ParamSpec]:
        return [spec_from_json(d) for d in self.call("parameters")["parameters"]]

    def stage(self, update: Update) -> None:
        raise TypeError("RemoteAdapter cannot send an in-memory Update; use stage_from_cache(manifest, cache_root) "
                        "(engine.control.stage_from_cache does this for any adapter)")

    def stage_from_cache(self, manifest_raw: bytes, cache_root) -> int:
        return self.call("stage", {"manifest": bytes(manifest_raw).decode("ascii"),
                                   "cache_root": os.fspath(cache_root)})["version"]

    def pause(self) -> None:
        self.call("pause")

    def apply(self) -> None:
        self.call("apply")

    def rollback(self) -> None:
        self.call("rollback")

    def load_full(self, update: Update) -> None:
        raise TypeError("RemoteAdapter cannot send an in-memory Update; use load_full_from_cache(manifest, "
                        "cache_root)")

    def load_full_from_cache(self, manifest_raw: bytes, cache_root) -> int:
        return self.call("load_full", {"manifest": bytes(manifest_raw).decode("ascii"),
                                       "cache_root": os.fspath(cache_root)})["version"]

    def resume(self) -> None:
        self.call("resume")

    def checksum(self, names: Sequence[str] | None = None) -> dict[str, int]:
        reply = self.call("checksum", {"names": list(names) if names is not None else None})
        return {k: int(v, 16) for k, v in reply["checksums"].items()}


# ---------------------------------------------------------------------------------------------- process


def _build_engine(args):
    """The engine a standalone process serves, holding the model folder's weights as version None (they
    are no version of any run; the daemon rebuilds them): the reference engine, or with ``--headless`` the
    weights-only ``engine.StateDictEngine``. Returns ``(adapter, generator or None)``."""
    from engine.reference.model import load_folder_weights

    if args.headless:
        from engine.state_dict import StateDictEngine

        return StateDictEngine(load_folder_weights(args.model), None), None
    from engine.reference import ReferenceEngine

    eng = ReferenceEngine.from_pretrained(args.model, version=None, max_batch=args.max_batch)
    return eng, eng


def main(argv=None) -> int:
    """``python -m engine.control --model DIR [--port P] [--ready-file F]``: serve one engine process."""
    p = argparse.ArgumentParser(prog="python -m engine.control", description=main.__doc__)
    p.add_argument("--model", required=True, help="model directory (config.json + safetensors)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    p.add_argument("--port", type=int, default=0, help="port (0: a free one, written to --ready-file)")
    p.add_argument("--ready-file", default=None, help="write {'url', 'pid'} here once serving")
    p.add_argument("--headless", action="store_true", help="weights only (engine.StateDictEngine), no generation")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--max-batch", type=int, default=8, help="requests running at once (reference engine)")
    p.add_argument("--log-level", default=os.environ.get("SYNCD_LOG_LEVEL", "WARNING"))
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(max(1, args.threads))
    adapter, generator = _build_engine(args)
    server = ControlServer(adapter, generator, host=args.host, port=args.port).start()
    log.info("engine serving at %s", server.url)
    if args.ready_file:
        tmp = args.ready_file + ".tmp"
        with open(tmp, "w") as fh:
            json.dump({"url": server.url, "pid": os.getpid()}, fh)
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
