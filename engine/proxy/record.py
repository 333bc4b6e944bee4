"""Trajectory records: what ``syncd.engine.proxy`` writes to the object store for every agent trajectory (the keys
and the JSON schema are specified in :mod:`syncd.records.trajectory`).

The reading half (schema constants, ``RecordError``, ``check_id``, ``record_key``, ``parse``, ``read_record``,
``list_records``, ``replay_tokens``) is :mod:`syncd.records.trajectory`'s, so that trainers read records
without importing ``syncd.engine``. This module keeps the writing half: :class:`Turn` and :class:`Trajectory` build a record; a trajectory is ``complete`` only when every
turn is ``ok``, otherwise ``failure`` says which turn failed and why. Nothing is ever dropped to make a record
look complete.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime, timezone

# used here and by syncd.engine.proxy's writer/server (RecordError, check_id): the reading half's names this module keeps
from syncd.records.trajectory import (SCHEMA, SCHEMA_VERSION, RecordError, check_id,  # noqa: F401
                                     check_tool_call, record_key)

__all__ = ["SCHEMA", "SCHEMA_VERSION", "Turn", "Trajectory", "RecordError", "record_key", "check_id", "now"]


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class Turn:
    """One request of a trajectory (the members are specified in :mod:`syncd.records.trajectory`)."""

    index: int
    endpoint: str
    request: dict
    stream: bool
    started_at: str = field(default_factory=now)
    status: str = "running"
    error: str | None = None
    attempts: list = field(default_factory=list)
    response_id: str | None = None
    request_id: str | None = None
    prompt_token_ids: list = field(default_factory=list)
    output_token_ids: list = field(default_factory=list)
    versions: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    text: str = ""
    usage: dict | None = None
    segments: list = field(default_factory=list)
    finished_at: str | None = None
    compaction: dict | None = None  # a segment of a compacted request (syncd.engine.proxy.compaction)

    def fail(self, reason: str) -> None:
        """Mark the turn failed (the first reason wins)."""
        if self.status != "failed":
            self.status, self.error = "failed", reason
        self.finished_at = self.finished_at or now()

    def to_json(self) -> dict:
        out = dict(self.__dict__)
        if out["compaction"] is None:
            del out["compaction"]
        return out


@dataclass
class Trajectory:
    """The turns of one trajectory, in the order their requests arrived."""

    run_id: str
    sandbox_id: str
    trajectory_id: str
    created_at: str = field(default_factory=now)
    turns: list[Turn] = field(default_factory=list)
    metadata: dict = field(default_factory=dict)
    finished_at: str | None = None
    #: the client's id; ``trajectory_id`` differs when the key was taken by an earlier proxy life
    requested_trajectory_id: str | None = None
    #: the tool calls the agent harness ran (``syncd.records.trajectory``: checked by ``check_tool_call``)
    tool_calls: list = field(default_factory=list)

    def __post_init__(self):
        if self.requested_trajectory_id is None:
            self.requested_trajectory_id = self.trajectory_id

    def add_tool_calls(self, calls) -> None:
        """Append the tool calls a harness ran (all or none: :class:`RecordError` naming the first bad member)."""
        if not isinstance(calls, list):
            raise RecordError("'tool_calls' must be a list")
        for i, c in enumerate(calls):
            check_tool_call(c, len(self.turns), where=f"tool call {i}")
        self.tool_calls.extend(calls)

    @property
    def failure(self) -> str | None:
        for t in self.turns:
            if t.status == "failed":
                return f"turn {t.index}: {t.error}"
            if t.status != "ok":
                return f"turn {t.index}: {t.status} when the trajectory was finished"
        return None

    @property
    def status(self) -> str:
        return "failed" if self.failure else "complete"

    @property
    def key(self) -> str:
        return record_key(self.run_id, self.sandbox_id, self.trajectory_id)

    @property
    def compactions(self) -> list[dict]:
        """The compaction boundaries: per summary turn, the request it belongs to, the context it summarized
        (tokens) and the turn that continued from it (None when the request ended there)."""
        out = []
        for t in self.turns:
            c = t.compaction or {}
            if c.get("role") == "summary":
                nxt = next((u.index for u in self.turns[t.index + 1:] if (u.compaction or {}).get("request")
                            == c["request"] and u.compaction.get("role") == "continuation"), None)
                out.append({"request": c["request"], "summary_turn": t.index, "context_tokens":
                            len(t.prompt_token_ids), "continuation_turn": nxt})
        return out

    def to_json(self) -> dict:
        extra = {"compactions": self.compactions} if any(t.compaction for t in self.turns) else {}
        return {**extra, "schema": SCHEMA, "schema_version": SCHEMA_VERSION, "run_id": self.run_id,
                "sandbox_id": self.sandbox_id, "trajectory_id": self.trajectory_id,
                "requested_trajectory_id": self.requested_trajectory_id, "status": self.status,
                "failure": self.failure, "created_at": self.created_at, "finished_at": self.finished_at,
                "metadata": self.metadata, "turns": [t.to_json() for t in self.turns],
                "tool_calls": list(self.tool_calls)}

    def encode(self) -> bytes:
        return json.dumps(self.to_json(), ensure_ascii=True, separators=(",", ":"), allow_nan=False).encode()
