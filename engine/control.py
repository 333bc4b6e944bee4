"""Out-of-process engine control: the ``POST /engine/weights/<op>`` routes, their engine-side half
(:class:`EngineControl`: credential, lease, write counter, signature check) and :class:`RemoteAdapter`, an
``engine.Adapter`` that drives an engine process through them. The HTTP server of a standalone engine
process is :mod:`engine.control_server` (``python -m engine.control --model DIR --port P``); the Dynamo worker
serves the same routes on its system port. Design: ``docs/engine.md``, "Who may drive an engine".

Routes (JSON body, JSON reply; errors reply 4xx/5xx with ``{"error": message, "type": class name}``)::

    version                                      -> state: {"run_id", "version", "writes", "instance", "lease"}
    lease                                        -> state              take or renew the lease (409 if held)
    release                                      -> state              give the lease back
    parameters                                   -> {"parameters": [spec, ...]}
    checksum   {"names": [...] or null}          -> {"checksums": {local name: "16 hex digits"}}
    stage      {"manifest": text, "cache_root"}  -> {"version": V}     update built from the node's shard cache
    pause                                        -> {}
    apply                                        -> {"version": V, "writes": N}
    rollback                                     -> {"version": V, "writes": N}
    load_full  {"manifest": text, "cache_root"}  -> {"version": V, "writes": N}   a full version, while paused
    resume                                       -> {}

Every request presents the node's engine token (``syncd.engine_token``): ``Authorization: Bearer <token>``
on the standalone server, the body member ``"auth"`` on Dynamo's system port (whose routes see only the
body); without it: 401 :class:`~syncd.errors.NotAuthorized`. ``lease``, ``release`` and the six weight ops
also carry ``"lease": {"holder", "run_id", "pid", "ttl_s"}``: one controller holds an engine at a time; a
weight op or ``lease`` from another holder while the lease is live is refused with 409
:class:`~syncd.errors.LeaseHeld` naming the holder's run and pid. ``writes`` counts the weight writes
(``apply``/``rollback``/``load_full``), which only the lease holder can make; ``instance`` changes when the
engine process restarts. ``run_id`` is the run of the manifest the weights were last loaded from.

Status codes: 401 no credential, 404 unknown op, 400 malformed body, 413 body too large, 422 bad data
(``ValueError`` and its subclasses such as ``DeltaError``/``IntegrityError``/``SignatureError``, or a shard
missing from the cache), 409 an op in the wrong state or a lease held by another (``RuntimeError``), 503 too
many requests at once, 500 anything else.
"""

from __future__ import annotations

import hmac
import http.client
import json
import logging
import os
import re
import threading
import time
import uuid
from typing import Sequence
from urllib.parse import urlsplit

import torch

from engine.adapter import ParamPiece, ParamSpec, Update
from syncd.errors import LeaseHeld, NotAuthorized

log = logging.getLogger(__name__)

__all__ = ["OPS", "WEIGHT_OPS", "EngineControl", "spec_to_json", "spec_from_json", "RemoteAdapter",
           "RemoteEngineError", "EngineUnreachable", "BadRequest", "stage_from_cache", "load_full_from_cache",
           "status_of"]

WEIGHT_OPS = ("stage", "pause", "apply", "rollback", "load_full", "resume")
OPS = ("version", "lease", "release", "parameters", "checksum") + WEIGHT_OPS
ROUTE_PREFIX = "/engine/weights/"
MAX_BODY_BYTES = 80 << 20  # a manifest (at most 64 MiB) as JSON text, and room for the rest
MAX_LEASE_S = 300.0


class BadRequest(ValueError):
    """A control request whose body is malformed (missing or mistyped member)."""


class RemoteEngineError(RuntimeError):
    """An engine process replied with an error of a type this side does not know; the message has it."""


class EngineUnreachable(ConnectionError):
    """The engine process did not answer (down, restarting, or not listening on that address)."""


# ---------------------------------------------------------------------------------------------- wire forms


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


def _lease_of(body: dict) -> dict:
    lease = body.get("lease")
    if not isinstance(lease, dict):
        raise BadRequest("this op needs 'lease': {holder, run_id, pid, ttl_s} (one controller per engine)")
    holder, run_id, pid, ttl = (lease.get(k) for k in ("holder", "run_id", "pid", "ttl_s"))
    if not isinstance(holder, str) or not 8 <= len(holder) <= 64:
        raise BadRequest("lease.holder must be a string of 8-64 characters")
    if run_id is not None and (not isinstance(run_id, str) or len(run_id) > 128):
        raise BadRequest("lease.run_id must be a run id or null")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid < 0:
        raise BadRequest("lease.pid must be a non-negative integer")
    if not isinstance(ttl, (int, float)) or isinstance(ttl, bool) or not 0.1 <= ttl <= MAX_LEASE_S:
        raise BadRequest(f"lease.ttl_s must be a number of seconds in 0.1..{MAX_LEASE_S:g}")
    return {"holder": holder, "run_id": run_id, "pid": pid, "ttl_s": float(ttl)}


def status_of(exc: BaseException) -> int:
    if isinstance(exc, NotAuthorized):
        return 401
    if isinstance(exc, KeyError):
        return 404
    if isinstance(exc, BadRequest):
        return 400
    if isinstance(exc, (ValueError, FileNotFoundError)):
        return 422
    if isinstance(exc, RuntimeError):
        return 409
    return 500


# ---------------------------------------------------------------------------------------------- engine side


class EngineControl:
    """The engine-side half of the control routes around one ``adapter`` (see the module docstring).

    ``token``: the node's engine token every call must present. ``signing_key``: as in
    :func:`syncd.signing.resolve_key` (None: ``SYNCD_SIGNING_KEY``/``_FILE`` now): with a key, ``stage`` and
    ``load_full`` verify the manifest's signature here, so an engine never loads a forged manifest even from
    a caller that has the token; without one the engine trusts its authenticated controller, which verified
    it. ``run_id``: the run the adapter's initial weights belong to (None: none/unknown).

    Thread-safe: the lease has its own lock (``version``/``lease`` answer at once, also during a long stage);
    weight ops are serialized under another (the Adapter contract's one controller at a time)."""

    def __init__(self, adapter, *, token: str, signing_key=None, run_id: str | None = None, clock=time.monotonic):
        from syncd.signing import resolve_key

        if not isinstance(token, str) or len(token) < 32:
            raise ValueError("EngineControl needs the node's engine token (syncd.engine_token.load_or_create)")
        self.adapter, self._token, self._clock = adapter, token.encode(), clock
        self.key = resolve_key(signing_key)
        self.run_id = run_id
        self.instance = uuid.uuid4().hex
        self.writes = 0
        self._staged_run: str | None = None
        self._lease: dict | None = None
        self._lease_lock = threading.Lock()
        self._weights_lock = threading.Lock()

    # ------------------------------------------------------------------------------------- state, lease

    def check_token(self, presented) -> None:
        if not isinstance(presented, str) or not hmac.compare_digest(presented.encode(), self._token):
            raise NotAuthorized("engine control needs the node's engine token (the file named by "
                                "SYNCD_ENGINE_TOKEN_FILE, default ~/.config/syncd/engine-token)")

    def state(self) -> dict:
        with self._lease_lock:
            lease = self._live_lease()
            lease = None if lease is None else {"run_id": lease["run_id"], "pid": lease["pid"],
                                                "expires_in_s": round(lease["expires"] - self._clock(), 3)}
        return {"run_id": self.run_id, "version": self.adapter.version, "writes": self.writes,
                "instance": self.instance, "lease": lease}

    def _live_lease(self) -> dict | None:
        if self._lease is not None and self._lease["expires"] <= self._clock():
            self._lease = None
        return self._lease

    def _take(self, lease: dict) -> None:
        """Take or renew ``lease`` (caller holds the lease lock); :class:`LeaseHeld` if another holds one."""
        cur = self._live_lease()
        if cur is not None and cur["holder"] != lease["holder"]:
            raise LeaseHeld(f"engine is controlled by run {cur['run_id']!r} (pid {cur['pid']}); its lease expires "
                            f"in {cur['expires'] - self._clock():.1f}s unless that controller renews it")
        if cur is None:
            log.info("engine lease taken by run %r (pid %d)", lease["run_id"], lease["pid"])
        self._lease = {**lease, "expires": self._clock() + lease["ttl_s"]}

    # ------------------------------------------------------------------------------------- calls

    def call(self, op: str, body, token) -> dict:
        """Run route ``op`` with the JSON ``body`` for a caller presenting ``token``; returns the reply.
        Raises as the module docstring's status codes say (the server maps them)."""
        self.check_token(token)
        if op not in OPS:
            raise KeyError(f"unknown engine op {op!r} (one of {', '.join(OPS)})")
        body = {} if body is None else body
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        if op == "version":
            return self.state()
        if op == "parameters":
            return {"parameters": [spec_to_json(s) for s in self.adapter.parameters()]}
        if op == "checksum":
            names = body.get("names")
            if names is not None and (not isinstance(names, list) or not all(isinstance(n, str) for n in names)):
                raise BadRequest("'names' must be a list of strings or null")
            return {"checksums": {k: f"{v:016x}" for k, v in self.adapter.checksum(names).items()}}
        lease = _lease_of(body)
        if op in ("lease", "release"):
            with self._lease_lock:
                if op == "lease":
                    self._take(lease)
                elif self._lease is not None and self._lease["holder"] == lease["holder"]:
                    self._lease = None
            return self.state()
        with self._lease_lock:
            self._take(lease)  # refuse early, before parsing a big manifest
        manifest, root = self._manifest(body, lease) if op in ("stage", "load_full") else (None, None)
        with self._weights_lock:
            with self._lease_lock:
                self._take(lease)  # again: another may have taken it while this call waited
            return self._weight_op(op, manifest, root)

    def _manifest(self, body: dict, lease: dict):
        from syncd import manifest as mf

        text, root = body.get("manifest"), body.get("cache_root")
        if not isinstance(text, str) or not isinstance(root, str) or not root:
            raise BadRequest("body needs 'manifest' (the manifest's JSON text) and 'cache_root' (a path)")
        try:
            raw = text.encode("ascii")
        except UnicodeEncodeError:
            raise BadRequest("manifest text is not ASCII (manifests are canonical ASCII JSON)") from None
        m = mf.parse(raw, key=self.key, allow_unsigned=self.key is None, where="manifest sent to the engine")
        if lease["run_id"] is not None and m.run_id != lease["run_id"]:
            raise ValueError(f"manifest of run {m.run_id!r} sent by the controller of run {lease['run_id']!r}")
        return m, root

    def _weight_op(self, op: str, m, root) -> dict:
        from syncd.cache import update_from_cache

        a = self.adapter
        if op == "stage":
            if m.kind == "delta" and self.run_id is not None and m.run_id != self.run_id:
                raise ValueError(f"the engine holds weights of run {self.run_id!r}; a delta of run {m.run_id!r} "
                                 "does not apply to them (load a full version first)")
            a.stage(update_from_cache(m, root))
            self._staged_run = m.run_id
            return {"version": m.version}
        if op in ("pause", "resume"):
            getattr(a, op)()
            return {}
        if op == "load_full" and m.kind != "full":
            raise ValueError(f"load_full needs a full version; version {m.version} is a delta")
        if op == "load_full":
            update = update_from_cache(m, root)
            self.run_id = None  # unknown until it succeeded
            try:
                a.load_full(update)
            finally:
                self.writes += 1  # a failed load_full may have written some weights
            self.run_id = m.run_id
        else:  # a failed apply or rollback leaves the weights as they were (the Adapter contract)
            getattr(a, op)()
            self.writes += 1
            if op == "apply":
                self.run_id = self._staged_run or self.run_id
        return {"version": a.version, "writes": self.writes}


# ---------------------------------------------------------------------------------------------- daemon side


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


_KNOWN_ERRORS = {c.__name__: c for c in (ValueError, RuntimeError, KeyError, TypeError, FileNotFoundError,
                                          PermissionError)}
_KNOWN_ERRORS["BadRequest"] = BadRequest

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

    Every call presents the node's engine token (``token``, else read from ``token_file`` /
    ``SYNCD_ENGINE_TOKEN_FILE`` at the first call) and this client's lease (``run_id``, this pid,
    ``lease_s``): the first weight op (or :meth:`lease`) takes it, each later call renews it.
    Errors come back as the engine raised them where the type is known (``DeltaError``, ``LeaseHeld``,
    ``ValueError``, ...), else as :class:`RemoteEngineError`; an engine that does not answer raises
    :class:`EngineUnreachable`. ``stage``/``load_full`` of an in-memory ``Update`` cannot cross the wire:
    use :meth:`stage_from_cache` / :meth:`load_full_from_cache` (the engine reads the node's shard cache).
    Thread-safe (a connection per call); the Adapter's one-controller rule still applies.
    """

    def __init__(self, base_url: str, *, timeout_s: float = 600.0, connect_timeout_s: float = 5.0,
                 token: str | None = None, token_file=None, run_id: str | None = None, lease_s: float = 10.0):
        u = urlsplit(base_url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"engine control URL must be http://host:port, got {base_url!r}")
        if not 0.1 <= lease_s <= MAX_LEASE_S:
            raise ValueError(f"lease_s must be in 0.1..{MAX_LEASE_S:g} seconds")
        self.base_url = base_url.rstrip("/")
        self.host, self.port = u.hostname, u.port or 80
        self.prefix = u.path.rstrip("/")
        self.timeout_s, self.connect_timeout_s = timeout_s, connect_timeout_s
        self._token, self._token_file = token, token_file
        self.holder = uuid.uuid4().hex
        self.run_id, self.lease_s = run_id, lease_s
        self.last_writes: int | None = None  # the engine's write counter after this client's last write

    def __repr__(self) -> str:
        return f"RemoteAdapter({self.base_url!r})"

    def credentials(self) -> dict:
        """The members every request body carries: ``auth`` (the token) and ``lease``."""
        if self._token is None:
            from syncd.engine_token import read_token

            self._token = read_token(self._token_file)
        return {"auth": self._token, "lease": {"holder": self.holder, "run_id": self.run_id, "pid": os.getpid(),
                                               "ttl_s": self.lease_s}}

    def call(self, op: str, body: dict | None = None, *, timeout_s: float | None = None) -> dict:
        """POST one control route and return its JSON reply (raises as described in the class docstring)."""
        creds = self.credentials()
        data = json.dumps({**(body or {}), **creds}).encode()
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.connect_timeout_s)
        try:
            try:
                conn.connect()
            except OSError as exc:
                raise EngineUnreachable(f"engine at {self.base_url} is not answering: {exc}") from None
            conn.sock.settimeout(timeout_s or self.timeout_s)
            try:
                conn.request("POST", f"{self.prefix}{ROUTE_PREFIX}{op}", body=data,
                             headers={"Content-Type": "application/json", "Authorization": f"Bearer {creds['auth']}"})
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
        if op in ("apply", "rollback", "load_full") and isinstance(reply.get("writes"), int):
            self.last_writes = reply["writes"]
        return reply

    # ------------------------------------------------------------------------------------- control state

    def state(self) -> dict:
        """``{"run_id", "version", "writes", "instance", "lease"}`` (no lease taken)."""
        return self.call("version", timeout_s=30)

    def lease(self) -> dict:
        """Take or renew this client's lease; the engine's state. :class:`LeaseHeld` if another holds it."""
        return self.call("lease", timeout_s=30)

    def release(self) -> None:
        """Give the lease back (a later controller need not wait for it to expire)."""
        self.call("release", timeout_s=30)

    # ------------------------------------------------------------------------------------- Adapter

    @property
    def version(self) -> int | None:
        return self.state()["version"]

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


if __name__ == "__main__":
    import sys

    from engine.control_server import main

    sys.exit(main())
