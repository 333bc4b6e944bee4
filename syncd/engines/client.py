"""The daemon's side of the control routes: :class:`RemoteAdapter`, an ``Adapter`` that drives an engine
process through them (wire format: :mod:`syncd.engines.wire`)."""

from __future__ import annotations

import http.client
import json
import os
import uuid
from typing import Sequence
from urllib.parse import urlsplit

from syncd.engines.errors import EngineUnreachable, RemoteEngineError
from syncd.engines.params import ParamSpec
from syncd.engines.update import Update
from syncd.engines.wire import _DYNAMO_ROUTE_ERROR, MAX_LEASE_S, ROUTE_PREFIX, error_class, spec_from_json

__all__ = ["RemoteAdapter", "stage_from_cache", "load_full_from_cache"]


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
            raise error_class(kind)(f"engine at {self.base_url}: {op}: {msg}")
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
