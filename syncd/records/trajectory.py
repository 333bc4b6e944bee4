"""Trajectory records, the reading half: what ``syncd.engine.proxy`` writes to the object store for every agent
trajectory, checked as hostile input. Part of the syncd core, so that the proxy (which writes them,
``syncd.engine.proxy.record``) and the trainer (which reads them, ``syncd.trainer.rl.rollouts``) share one schema.

Key (create-if-absent, never overwritten)::

    runs/<run_id>/trajectories/<sandbox_id>/<trajectory_id>.json

A record is one JSON object (``schema: "syncd.trajectory"``, ``schema_version: 2``)::

    {"run_id", "sandbox_id", "trajectory_id", "requested_trajectory_id", "status": "complete" | "failed",
     "failure": null | reason, "created_at", "finished_at", "metadata": {...},
     "turns": [{"index", "endpoint": "chat/completions" | "completions", "request": <client's JSON body>,
                "stream", "status": "ok" | "failed", "error": null | reason, "attempts": [...],
                "response_id", "request_id", "prompt_token_ids", "output_token_ids", "versions",
                "logprobs", "finish_reason", "text", "usage", "segments": [{"request_id", "start", "count"}],
                "started_at", "finished_at"}],
     "tool_calls": [{"turn", "id", "name", "arguments", "output", "started_at", "wall_s", "status",
                     "exit_code", "output_bytes", "truncated"}]}

**Tool calls** (version 2): every tool call the agent harness ran for the trajectory, in the order it ran them
(``syncd.trainer.agent``; posted to the proxy, ``POST /syncd/trajectories/<id>/tool_calls``): ``turn`` is the
index of the turn whose output made the call (-1: a call the harness made on its own), ``id`` the call's id
(the ``tool_call_id`` of the ``tool`` message that answered it in the next turn's request), ``name`` and
``arguments`` (the raw string the model wrote) what was called, ``output`` what the model was shown (None when
nothing was), ``wall_s`` the seconds the tool ran, ``status`` how it ended (:data:`TOOL_STATUSES`),
``exit_code`` a command's exit status (None when killed or not a command), ``output_bytes`` the bytes it wrote
and ``truncated`` whether ``output`` is cut. Version 1 records (no tool calls member) still read: :func:`parse`
gives them ``"tool_calls": []``.

Self-compaction (``syncd.engine.proxy.compaction``) adds optional members (records without it are unchanged): a turn that is a segment of a compacted client request carries ``"compaction":
{"request": <index of the request's first segment>, "segment", "role": "generate" | "summary" | "continuation",
"client_request"?: <the client's body, on the first segment>}`` (its ``request`` is then the body sent upstream,
with the prompt as token ids), and the record lists the boundaries, ``"compactions": [{"request", "summary_turn",
"context_tokens", "continuation_turn": int | null}]``.

``request_id`` is the id the engines recorded their replay records under (:func:`syncd.records.read_request`);
``versions[i]`` is the weight version output token ``i`` was sampled with; ``segments`` are the runs of the
turn on one worker each (more than one when Dynamo migrated the request). A trajectory is ``complete`` only
when every turn is ``ok``; otherwise ``failure`` says which turn failed and why. Nothing is ever dropped to
make a record look complete. ``requested_trajectory_id`` is the id the client used; the proxy stores a
record under another id (``<id>.<proxy life>``) only when an earlier proxy life already wrote that key
(``syncd.engine.proxy.writer``).

:func:`parse` treats a stored record as hostile: size-bounded, strict JSON, every member checked.
"""

from __future__ import annotations

import re

from syncd import jsonsafe
from syncd import manifest as mf
from syncd.errors import SyncdError

__all__ = ["SCHEMA", "SCHEMA_VERSION", "READABLE_VERSIONS", "TOOL_STATUSES", "MAX_RECORD_BYTES", "RecordError",
           "check_id", "record_key", "parse", "check_tool_call", "read_record", "list_records", "replay_tokens"]

SCHEMA = "syncd.trajectory"
SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)
TOOL_STATUSES = ("ok", "error", "timeout", "killed", "refused")
COMPACTION_ROLES = ("generate", "summary", "continuation")
MAX_RECORD_BYTES = 1 << 30
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class RecordError(SyncdError, ValueError):
    """A trajectory record (or an id for one) is malformed."""


def check_id(value, what: str) -> str:
    """``value`` if it is 1-128 characters of ``[A-Za-z0-9._-]`` starting with a letter or digit, no ``..``."""
    if not isinstance(value, str) or not _ID.match(value) or ".." in value:
        raise RecordError(f"{what} must be 1-128 characters of [A-Za-z0-9._-] starting with a letter or digit, "
                          f"got {value!r}")
    return value


def record_key(run_id: str, sandbox_id: str, trajectory_id: str) -> str:
    return (f"{mf.run_prefix(run_id)}trajectories/{check_id(sandbox_id, 'sandbox id')}/"
            f"{check_id(trajectory_id, 'trajectory id')}.json")


# ---------------------------------------------------------------------------------------------- reading


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _count(v) -> bool:
    return _is_int(v) and v >= 0


def _ints(v, what: str) -> list:
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise RecordError(f"{what} must be a list of integers")
    return v


def parse(raw: bytes, *, where: str = "trajectory record") -> dict:
    """The record in ``raw``, checked (see the module docstring). Raises :class:`RecordError`."""
    if len(raw) > MAX_RECORD_BYTES:
        raise RecordError(f"{where}: larger than {MAX_RECORD_BYTES} bytes")
    try:  # strict and bounded (syncd.jsonsafe): the client's bodies nest at most 64 deep, a few levels down
        doc = jsonsafe.loads(raw, what="the text", max_bytes=MAX_RECORD_BYTES, max_depth=jsonsafe.MAX_DEPTH + 8)
    except jsonsafe.JSONError as exc:
        raise RecordError(f"{where}: not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise RecordError(f"{where}: not a {SCHEMA} record")
    if doc.get("schema_version") not in READABLE_VERSIONS or isinstance(doc.get("schema_version"), bool):
        raise RecordError(f"{where}: schema_version {doc.get('schema_version')!r} is not one of "
                          f"{READABLE_VERSIONS}")
    for k in ("run_id", "sandbox_id", "trajectory_id"):
        check_id(doc.get(k), f"{where}: {k}")
    if doc.get("status") not in ("complete", "failed"):
        raise RecordError(f"{where}: status {doc.get('status')!r}")
    turns = doc.get("turns")
    if not isinstance(turns, list):
        raise RecordError(f"{where}: turns must be a list")
    for i, t in enumerate(turns):
        w = f"{where}: turn {i}"
        if not isinstance(t, dict) or t.get("index") != i:
            raise RecordError(f"{w}: malformed or out of order")
        if t.get("status") not in ("ok", "failed", "running"):
            raise RecordError(f"{w}: status {t.get('status')!r}")
        n = len(_ints(t.get("output_token_ids"), f"{w}: output_token_ids"))
        _ints(t.get("prompt_token_ids"), f"{w}: prompt_token_ids")
        versions = t.get("versions")
        if not isinstance(versions, list) or len(versions) != n or not all(
                v is None or (isinstance(v, int) and not isinstance(v, bool)) for v in versions):
            raise RecordError(f"{w}: versions must list one version (int or null) per output token")
        c = t.get("compaction")
        if c is not None and not (isinstance(c, dict) and c.get("role") in COMPACTION_ROLES
                                  and _is_int(c.get("request")) and _is_int(c.get("segment"))):
            raise RecordError(f"{w}: malformed compaction member {str(c)[:200]}")
        segs = t.get("segments")
        if not isinstance(segs, list) or not all(isinstance(s, dict) and _count(s.get("count")) for s in segs):
            raise RecordError(f"{w}: segments must be objects with a count (an int >= 0)")
        if sum(s["count"] for s in segs) != n:
            raise RecordError(f"{w}: segments do not cover the {n} output tokens")
    marks = doc.get("compactions", [])
    if not isinstance(marks, list) or not all(
            isinstance(m, dict) and _is_int(m.get("summary_turn")) and 0 <= m["summary_turn"] < len(turns)
            and (turns[m["summary_turn"]].get("compaction") or {}).get("role") == "summary" for m in marks):
        raise RecordError(f"{where}: compactions must name summary turns of the record")
    if (doc["status"] == "complete") != all(t["status"] == "ok" for t in turns):
        raise RecordError(f"{where}: status {doc['status']} contradicts its turns")
    calls = doc.setdefault("tool_calls", []) if doc["schema_version"] == 1 else doc.get("tool_calls")
    if not isinstance(calls, list):
        raise RecordError(f"{where}: tool_calls must be a list")
    for i, c in enumerate(calls):
        check_tool_call(c, len(turns), where=f"{where}: tool call {i}")
    return doc


def check_tool_call(c, turns: int, *, where: str = "tool call") -> dict:
    """``c`` if it is a well-formed tool call of a record with ``turns`` turns (module docstring), else
    :class:`RecordError` naming the member."""
    if not isinstance(c, dict):
        raise RecordError(f"{where}: not an object")
    checks = (("turn", _is_int(c.get("turn")) and -1 <= c["turn"] < max(turns, 0)),
              ("id", isinstance(c.get("id"), str) and 0 < len(c["id"]) <= 256),
              ("name", isinstance(c.get("name"), str) and 0 < len(c["name"]) <= 256),
              ("arguments", isinstance(c.get("arguments"), str)),
              ("output", c.get("output") is None or isinstance(c["output"], str)),
              ("wall_s", isinstance(c.get("wall_s"), (int, float)) and not isinstance(c["wall_s"], bool)
               and 0 <= c["wall_s"] < float("inf")),
              ("status", c.get("status") in TOOL_STATUSES),
              ("exit_code", c.get("exit_code") is None or _is_int(c["exit_code"])),
              ("output_bytes", _count(c.get("output_bytes", 0))),
              ("truncated", isinstance(c.get("truncated", False), bool)))
    for member, ok in checks:
        if not ok:
            raise RecordError(f"{where}: malformed {member} {str(c.get(member))[:100]!r}")
    return c


def read_record(store, run_id: str, sandbox_id: str, trajectory_id: str) -> dict:
    """The checked record of one trajectory (raises ``syncd.errors.ObjectNotFound`` or :class:`RecordError`)."""
    from syncd.store import Store

    store = Store.open(store)
    key = record_key(run_id, sandbox_id, trajectory_id)
    raw = store.get(key, limit=MAX_RECORD_BYTES + 1)
    doc = parse(bytes(raw), where=f"{store.url}/{key}")
    if (doc["run_id"], doc["sandbox_id"], doc["trajectory_id"]) != (run_id, sandbox_id, trajectory_id):
        raise RecordError(f"{store.url}/{key}: the record names another trajectory")
    return doc


def list_records(store, run_id: str, sandbox_id: str | None = None) -> list[tuple[str, str]]:
    """``(sandbox_id, trajectory_id)`` of every record of the run (of one sandbox when given), sorted."""
    from syncd.store import Store

    store = Store.open(store)
    prefix = f"{mf.run_prefix(run_id)}trajectories/"
    if sandbox_id is not None:
        prefix += f"{check_id(sandbox_id, 'sandbox id')}/"
    out = []
    for o in store.list(prefix):
        rest = o.key[len(mf.run_prefix(run_id)) + len("trajectories/"):]
        sb, _, name = rest.partition("/")
        if name.endswith(".json") and "/" not in name:
            out.append((sb, name[:-5]))
    return sorted(out)


def replay_tokens(store, run_id: str, turn: dict) -> dict[int, tuple[int, int | None]]:
    """What the engines' replay records say about ``turn``'s output: ``{output index: (token id, version)}``
    over every worker that served it (a migrated request has records from each). Compare with the turn's
    ``output_token_ids``/``versions`` to check the link; positions a killed worker never wrote are absent.
    Raises ``syncd.records.ReplayFormatError`` for a corrupt chunk."""
    from syncd.records.replay_store import read_request

    out: dict[int, tuple[int, int | None]] = {}
    start = len(turn.get("prompt_token_ids") or [])
    for rid in dict.fromkeys(s["request_id"] for s in turn.get("segments") or []):
        for chunk in read_request(store, run_id, rid):
            for rec in chunk.records:
                out[rec.position - start] = (rec.token_id, rec.version)
    return out
