"""The daemon's side of the control routes: :class:`RemoteAdapter`, an :class:`~syncd.engines.protocol.Adapter`
(and :class:`~syncd.engines.protocol.EngineLink`) that drives an engine process through them (routes and wire
format: :mod:`syncd.engines.wire`)."""

from __future__ import annotations

import json
import os
import uuid
from typing import Sequence

from syncd import http_client, jsonsafe
from syncd.engines import wire
from syncd.engines.errors import EngineUnreachable, RemoteEngineError
from syncd.engines.update import Update

__all__ = ["RemoteAdapter"]


class RemoteAdapter:
    """An engine process's control routes at ``base_url`` (``http://host:port``; a Dynamo worker's system port
    works too) as an ``Adapter`` and ``EngineLink``.

    ``stage``/``load_full`` take an :class:`~syncd.engines.update.Update` of a version in the node cache
    (:meth:`Update.from_cache <syncd.engines.update.Update.from_cache>`): the engine is sent the manifest and
    the cache root and reads the shards itself; an update held only in this process's memory raises
    ``ValueError`` (it cannot cross the wire). Every call presents the node's engine token (``token``, else
    read from ``token_file`` / ``SYNCD_ENGINE_TOKEN_FILE`` at the first call) and this client's lease
    (``run_id``, this pid, ``lease_s``): the first weight op (or :meth:`lease`) takes it, each later call renews
    it. Errors come back as the engine raised them where the type is known (``DeltaError``, ``LeaseHeld``,
    ``ValueError``, ...), else as :class:`RemoteEngineError`; an engine that does not answer raises
    :class:`EngineUnreachable`. Thread-safe (a connection per call); the Adapter's one-controller rule still
    applies.
    """

    def __init__(self, base_url: str, *, timeout_s: float = 600.0, connect_timeout_s: float = 5.0,
                 token: str | None = None, token_file=None, run_id: str | None = None, lease_s: float = 10.0):
        self._url = http_client.split_url(base_url, "engine control URL")
        if not 0.1 <= lease_s <= wire.MAX_LEASE_S:
            raise ValueError(f"lease_s must be in 0.1..{wire.MAX_LEASE_S:g} seconds")
        self.base_url = base_url.rstrip("/")
        self.timeout_s, self.connect_timeout_s = timeout_s, connect_timeout_s
        self._token, self._token_file = token, token_file
        self.holder = uuid.uuid4().hex
        self.run_id, self.lease_s = run_id, lease_s
        self.last_writes: int | None = None  # the engine's write counter after this client's last write

    def __repr__(self) -> str:
        return f"RemoteAdapter({self.base_url!r})"

    @property
    def url(self) -> str:
        return self.base_url

    def credentials(self) -> dict:
        """The members every request body carries: ``auth`` (the token) and ``lease``."""
        if self._token is None:
            from syncd.engine_token import read_token

            self._token = read_token(self._token_file)
        return {"auth": self._token, "lease": {"holder": self.holder, "run_id": self.run_id, "pid": os.getpid(),
                                               "ttl_s": self.lease_s}}

    def call(self, op: str, body: dict | None = None, *, timeout_s: float | None = None) -> dict:
        """POST route ``op`` (one of :data:`~syncd.engines.wire.ROUTES`) and return its JSON reply (raises as
        described in the class docstring)."""
        route = wire.ROUTES.get(op)
        if timeout_s is None:
            timeout_s = wire.QUICK_TIMEOUT_S if route is not None and route.quick else self.timeout_s
        creds = self.credentials()
        data = json.dumps({**(body or {}), **creds}).encode()
        try:
            got = http_client.request(
                "POST", self._url, f"{wire.ROUTE_PREFIX}{op}", body=data,
                headers={"Content-Type": "application/json", "Authorization": f"Bearer {creds['auth']}"},
                connect_timeout_s=self.connect_timeout_s, timeout_s=timeout_s, max_reply_bytes=wire.MAX_BODY_BYTES)
        except http_client.Unreachable as exc:
            raise EngineUnreachable(f"engine at {self.base_url}: {op}: {exc}") from None
        except http_client.ReplyTooLarge:
            raise RemoteEngineError(f"engine at {self.base_url}: {op} replied over {wire.MAX_BODY_BYTES} bytes") from None
        raw, status = got.body, got.status
        try:
            reply = jsonsafe.loads(raw, what=f"{op} reply", max_bytes=wire.MAX_BODY_BYTES, max_depth=8) if raw else {}
        except jsonsafe.JSONError:
            raise RemoteEngineError(f"engine at {self.base_url}: {op} replied {status} with non-JSON "
                                    f"{raw[:200]!r}") from None
        if status != 200:
            wire.raise_error(status, reply, f"engine at {self.base_url}: {op}")
        if not isinstance(reply, dict):
            raise RemoteEngineError(f"engine at {self.base_url}: {op} replied {str(reply)[:200]}, not a JSON object")
        if route is not None and route.writes and isinstance(reply.get("writes"), int):
            self.last_writes = reply["writes"]
        return reply

    # ------------------------------------------------------------------------------------- control state

    def state(self) -> dict:
        """``{"run_id", "version", "writes", "instance", "lease"}`` (no lease taken)."""
        return self.call("version")

    def lease(self) -> dict:
        """Take or renew this client's lease; the engine's state. :class:`LeaseHeld` if another holds it."""
        return self.call("lease")

    def release(self) -> None:
        """Give the lease back (a later controller need not wait for it to expire)."""
        self.call("release")

    # ------------------------------------------------------------------------------------- Adapter

    @property
    def version(self) -> int | None:
        return self.state()["version"]

    def parameters(self) -> Sequence:
        return [wire.spec_from_json(d) for d in self.call("parameters")["parameters"]]

    def stage(self, update: Update) -> None:
        self.call("stage", wire.cached_body(update))

    def pause(self) -> None:
        self.call("pause")

    def apply(self) -> None:
        self.call("apply")

    def rollback(self) -> None:
        self.call("rollback")

    def load_full(self, update: Update) -> None:
        self.call("load_full", wire.cached_body(update))

    def resume(self) -> None:
        self.call("resume")

    def checksum(self, names: Sequence[str] | None = None) -> dict[str, int]:
        reply = self.call("checksum", {"names": list(names) if names is not None else None})
        return {k: int(v, 16) for k, v in reply["checksums"].items()}
