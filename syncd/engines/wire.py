"""The engine control routes and their wire format (``POST /engine/weights/<op>``), specified once: the table
:data:`ROUTES` and the body/reply forms below, shared by the engine-side half (``syncd.engines.control.EngineControl``,
served by ``syncd.engine.control_server`` and the Dynamo worker) and the client
(:class:`syncd.engines.client.RemoteAdapter`). Design: ``docs/engine.md``, "Who may drive an engine".

Every route takes a JSON object and replies one; an error replies 4xx/5xx with ``{"error": message, "type":
class name}`` (:func:`error_reply`), which the client raises again as that class (:func:`raise_error`).

Every request presents the node's engine token (``syncd.engine_token``): ``Authorization: Bearer <token>``
on the standalone server, the body member ``"auth"`` on Dynamo's system port (whose routes see only the
body); without it: 401 :class:`~syncd.errors.NotAuthorized`. The routes that say ``lease`` also carry
``"lease": {"holder", "run_id", "pid", "ttl_s"}`` (:func:`lease_of`): one controller holds an engine at a time;
such a route from another holder while the lease is live is refused with 409 :class:`~syncd.errors.LeaseHeld`
naming the holder's run and pid. ``state`` is ``{"run_id", "version", "writes", "instance", "lease"}``:
``writes`` counts the weight writes (the routes that say ``writes``), which only the lease holder can make;
``instance`` changes when the engine process restarts; ``run_id`` is the run of the manifest the weights were
last loaded from; ``lease`` is ``{"run_id", "pid", "expires_in_s"}`` of the live lease, or null.

Status codes (:func:`status_of`): 401 no credential, 404 unknown op, 400 malformed body, 413 body too large,
422 bad data (``ValueError`` and its subclasses such as ``DeltaError``/``IntegrityError``/``SignatureError``, or
a shard missing from the cache), 409 an op in the wrong state or a lease held by another (``RuntimeError``),
503 too many requests at once, 500 anything else.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from syncd.engines.errors import BadRequest, RemoteEngineError
from syncd.errors import NotAuthorized

__all__ = ["Route", "ROUTES", "OPS", "WEIGHT_OPS", "ROUTE_PREFIX", "MAX_BODY_BYTES", "MAX_LEASE_S", "spec_to_json",
           "spec_from_json", "lease_of", "cached_body", "cached_of", "names_of", "status_of", "error_reply",
           "error_class", "raise_error"]

ROUTE_PREFIX = "/engine/weights/"
MAX_BODY_BYTES = 80 << 20  # a manifest (at most 64 MiB) as JSON text, and room for the rest
MAX_LEASE_S = 300.0


@dataclass(frozen=True)
class Route:
    """One control route. ``body``: the members it takes besides ``auth`` and ``lease``; ``reply``: what it
    answers; ``lease``: it needs this controller's lease (weight routes are also serialized, one at a time);
    ``writes``: it writes weights (moves the ``writes`` counter); ``quick``: it answers at once, even during a
    long weight op (a client waits ``QUICK_TIMEOUT_S`` for it, else its own, long, timeout)."""

    op: str
    body: str
    reply: str
    lease: bool = True
    writes: bool = False
    quick: bool = False


QUICK_TIMEOUT_S = 30.0

ROUTES = {r.op: r for r in (
    Route("version", "", "state", lease=False, quick=True),
    Route("lease", "", "state (take or renew the lease)", quick=True),
    Route("release", "", "state (give the lease back)", quick=True),
    Route("parameters", "", '{"parameters": [spec, ...]}', lease=False),
    Route("checksum", '{"names": [...] or null}', '{"checksums": {local name: "16 hex digits"}}', lease=False),
    Route("stage", '{"manifest": text, "cache_root": path}', '{"version": V}'),
    Route("pause", "", "{}"),
    Route("apply", "", '{"version": V, "writes": N}', writes=True),
    Route("rollback", "", '{"version": V, "writes": N}', writes=True),
    Route("load_full", '{"manifest": text, "cache_root": path}', '{"version": V, "writes": N} (while paused)',
          writes=True),
    Route("resume", "", "{}"),
)}
OPS = tuple(ROUTES)
#: the routes that drive the weights (the Adapter's calls): they need the lease and run one at a time
WEIGHT_OPS = tuple(op for op, r in ROUTES.items() if r.lease and not r.quick)


# ---------------------------------------------------------------------------------------------- bodies


def spec_to_json(spec) -> dict:
    """A :class:`~syncd.engines.params.ParamSpec` as the ``parameters`` route sends it."""
    return {"name": spec.name, "dtype": str(spec.dtype).removeprefix("torch."), "shape": list(spec.shape),
            "device": str(spec.device),
            "pieces": [{"source": p.source, "source_shape": list(p.source_shape), "dim": p.dim,
                        "start": p.start, "stop": p.stop, "local_start": p.local_start} for p in spec.pieces]}


def spec_from_json(d: dict):
    """The :class:`~syncd.engines.params.ParamSpec` of :func:`spec_to_json`'s form; :class:`BadRequest` if malformed."""
    import torch

    from syncd.engines.params import ParamPiece, ParamSpec

    try:
        return ParamSpec(d["name"], getattr(torch, d["dtype"]), tuple(d["shape"]), d["device"],
                         tuple(ParamPiece(p["source"], tuple(p["source_shape"]), p["dim"], p["start"], p["stop"],
                                          p["local_start"]) for p in d["pieces"]))
    except (KeyError, TypeError, AttributeError) as exc:
        raise BadRequest(f"malformed parameter spec: {exc!r}") from None


def lease_of(body: dict) -> dict:
    """The ``lease`` member of a route that needs it, checked; :class:`BadRequest` if missing or malformed."""
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


def cached_body(update) -> dict:
    """The body of ``stage``/``load_full`` for an :class:`~syncd.engines.update.Update` of a version in the node
    cache: its manifest's exact text and the cache root. ``ValueError`` for an update held in memory only."""
    src = update.source
    if src is None or src.raw is None:
        raise ValueError(f"version {update.version}: an engine in another process reads an update from the node "
                         "cache; this one is held in memory (make it with syncd.engines.Update.from_cache)")
    return {"manifest": bytes(src.raw).decode("ascii"), "cache_root": src.cache_root}


def cached_of(body: dict) -> tuple[bytes, str]:
    """``(manifest bytes, cache root)`` of a ``stage``/``load_full`` body; :class:`BadRequest` if malformed."""
    text, root = body.get("manifest"), body.get("cache_root")
    if not isinstance(text, str) or not isinstance(root, str) or not root:
        raise BadRequest("body needs 'manifest' (the manifest's JSON text) and 'cache_root' (a path)")
    try:
        return text.encode("ascii"), root
    except UnicodeEncodeError:
        raise BadRequest("manifest text is not ASCII (manifests are canonical ASCII JSON)") from None


def names_of(body: dict) -> list[str] | None:
    """The ``names`` of a ``checksum`` body; :class:`BadRequest` unless a list of strings or null."""
    names = body.get("names")
    if names is not None and (not isinstance(names, list) or not all(isinstance(n, str) for n in names)):
        raise BadRequest("'names' must be a list of strings or null")
    return names


# ---------------------------------------------------------------------------------------------- errors


def status_of(exc: BaseException) -> int:
    """The HTTP status of an exception a route raised (see the module docstring)."""
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


def error_reply(exc: BaseException) -> tuple[int, dict]:
    """``(status, {"error", "type"})`` of an exception a route raised."""
    msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
    return status_of(exc), {"error": str(msg), "type": type(exc).__name__}


_KNOWN_ERRORS = {c.__name__: c for c in (ValueError, RuntimeError, KeyError, TypeError, FileNotFoundError,
                                          PermissionError, BadRequest)}

# How Dynamo 1.6's system server reports an exception raised by an engine route (it cannot set the status).
_DYNAMO_ROUTE_ERROR = re.compile(r"^Python callback failed: (\w+): (.*)\Z", re.DOTALL)


def error_class(name: str):
    """The exception class an error reply's ``type`` names: a :mod:`syncd.errors` class, a builtin the routes
    raise, :class:`BadRequest`, else :class:`RemoteEngineError`."""
    from syncd import errors

    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        return cls
    return _KNOWN_ERRORS.get(name, RemoteEngineError)


def raise_error(status: int, reply, where: str):
    """Raise the error a non-200 reply carries (Dynamo's own envelope included), its message prefixed by
    ``where`` (e.g. ``"engine at http://...: stage"``)."""
    msg = reply.get("error", f"HTTP {status}") if isinstance(reply, dict) else str(reply)
    kind = reply.get("type", "") if isinstance(reply, dict) else ""
    if not kind and isinstance(reply, dict):  # Dynamo's system server: its own envelope, status 500
        m = _DYNAMO_ROUTE_ERROR.match(str(reply.get("message", "")))
        if m:
            kind, msg = m.group(1), m.group(2)
    raise error_class(kind)(f"{where}: {msg}")
