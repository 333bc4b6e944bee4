"""The engine control routes and their wire format (``POST /engine/weights/<op>``), shared by the engine-side
half (``engine.control.EngineControl``, served by ``engine.control_server`` and the Dynamo worker) and the
client (:class:`syncd.engines.client.RemoteAdapter`). Design: ``docs/engine.md``, "Who may drive an engine".

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

import re

import torch

from syncd.engines.errors import BadRequest, RemoteEngineError
from syncd.engines.params import ParamPiece, ParamSpec
from syncd.errors import NotAuthorized

__all__ = ["OPS", "WEIGHT_OPS", "ROUTE_PREFIX", "MAX_BODY_BYTES", "MAX_LEASE_S", "spec_to_json", "spec_from_json",
           "lease_of", "status_of", "error_class"]

WEIGHT_OPS = ("stage", "pause", "apply", "rollback", "load_full", "resume")
OPS = ("version", "lease", "release", "parameters", "checksum") + WEIGHT_OPS
ROUTE_PREFIX = "/engine/weights/"
MAX_BODY_BYTES = 80 << 20  # a manifest (at most 64 MiB) as JSON text, and room for the rest
MAX_LEASE_S = 300.0


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


def lease_of(body: dict) -> dict:
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


_KNOWN_ERRORS = {c.__name__: c for c in (ValueError, RuntimeError, KeyError, TypeError, FileNotFoundError,
                                          PermissionError)}
_KNOWN_ERRORS["BadRequest"] = BadRequest

# How Dynamo 1.6's system server reports an exception raised by an engine route (it cannot set the status).
_DYNAMO_ROUTE_ERROR = re.compile(r"^Python callback failed: (\w+): (.*)\Z", re.DOTALL)


def error_class(name: str):
    from syncd import errors

    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        return cls
    return _KNOWN_ERRORS.get(name, RemoteEngineError)
