"""Out-of-process engine control, the engine-side half: :class:`EngineControl` (credential, lease, write
counter, signature check) runs the ``POST /engine/weights/<op>`` routes around an adapter. The routes and
their wire format are specified once in :mod:`syncd.engines.wire`; the daemon's client is
:class:`syncd.engines.client.RemoteAdapter`. The HTTP server of a standalone engine process is
:mod:`syncd.engine.control_server` (``python -m syncd.engine.control_server --model DIR --port P``); the Dynamo
worker serves the same routes on its system port. Design: ``docs/engine.md``, "Who may drive an engine".
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
import uuid

from syncd.engines.errors import BadRequest
from syncd.engines.update import Update
from syncd.engines.wire import ROUTES, cached_of, lease_of, names_of, spec_to_json
from syncd.errors import LeaseHeld, NotAuthorized

log = logging.getLogger(__name__)

__all__ = ["EngineControl"]


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
        """Run route ``op`` (:data:`syncd.engines.wire.ROUTES`) with the JSON ``body`` for a caller presenting
        ``token``; returns the reply. Raises as :mod:`syncd.engines.wire` says (the server maps the status)."""
        self.check_token(token)
        route = ROUTES.get(op)
        if route is None:
            raise KeyError(f"unknown engine op {op!r} (one of {', '.join(ROUTES)})")
        body = {} if body is None else body
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        if op == "version":
            return self.state()
        if op == "parameters":
            return {"parameters": [spec_to_json(s) for s in self.adapter.parameters()]}
        if op == "checksum":
            return {"checksums": {k: f"{v:016x}" for k, v in self.adapter.checksum(names_of(body)).items()}}
        lease = lease_of(body)
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

        raw, root = cached_of(body)
        m = mf.parse(raw, key=self.key, allow_unsigned=self.key is None, where="manifest sent to the engine")
        if lease["run_id"] is not None and m.run_id != lease["run_id"]:
            raise ValueError(f"manifest of run {m.run_id!r} sent by the controller of run {lease['run_id']!r}")
        return m, root

    def _weight_op(self, op: str, m, root) -> dict:
        a = self.adapter
        if op == "stage":
            if m.kind == "delta" and self.run_id is not None and m.run_id != self.run_id:
                raise ValueError(f"the engine holds weights of run {self.run_id!r}; a delta of run {m.run_id!r} "
                                 "does not apply to them (load a full version first)")
            a.stage(Update.from_cache(m, root).load())  # the shards are read (and re-hashed) here, in-process
            self._staged_run = m.run_id
            return {"version": m.version}
        if op in ("pause", "resume"):
            getattr(a, op)()
            return {}
        if op == "load_full" and m.kind != "full":
            raise ValueError(f"load_full needs a full version; version {m.version} is a delta")
        if op == "load_full":
            update = Update.from_cache(m, root).load()
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
