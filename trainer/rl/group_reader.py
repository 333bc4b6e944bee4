"""Reading a group back from the store: its trajectories joined with their replay records, checked -- what the
rollout workers check a group they made with (:mod:`syncd.trainer.rl.rollout_workers`), and what the trainer rebuilds a
checkpointed or queued group with (:mod:`syncd.trainer.rl.queue_feed`, :mod:`syncd.trainer.rl.live`).

A group's records must all be complete, join their replay records (waiting up to ``record_timeout_s`` for the
ones the engines write just after a request ends) and, when recorded, carry the same per-token versions; anything
else raises ``_Failed`` with its kind (``replay``, ``record``). Thread-safe: a reader holds no state per group.
"""

from __future__ import annotations

import time

from syncd.errors import ObjectNotFound
from syncd.store import Store
from syncd.trainer.rl.buffer import Group
from syncd.trainer.rl.rollouts import MissingReplayError, RolloutError, read_rollouts
from syncd.trainer.rl.tasks import TaskItem

__all__ = ["GroupReader"]


class GroupReader:
    """Reads a group back from the store: its trajectories joined with their replay records
    (:func:`syncd.trainer.rl.rollouts.read_rollouts`, waiting up to ``record_timeout_s`` for records the engines
    write just after a request ends). What the rollout workers check a group they made with, and what the trainer
    rebuilds a checkpointed or queued group with (:meth:`reread`). Thread-safe."""

    def __init__(self, store, run_id: str, *, vocab_size: int | None = None, record_timeout_s: float = 60.0,
                 multi_turn: bool = False):
        self.store, self.run_id, self.vocab_size = Store.open(store), run_id, vocab_size
        self.record_timeout_s, self.multi_turn = record_timeout_s, multi_turn

    def reread(self, doc: dict) -> Group:
        """A group from its plan with ``token_versions`` (a checkpoint's buffered group, a queued group), read
        back from the store; ``_Failed`` when the records are gone or no longer carry the recorded per-token
        versions."""
        ids = [tuple(t) for t in doc["trajectories"]]
        rollouts = self.read(ids)
        want = doc.get("token_versions")
        got = [_token_versions(ro) for ro in rollouts]
        if want is not None and got != want:
            raise _Failed("record", f"group of prompt {doc['item']['index']}: the records' token versions differ "
                                    "from the recorded ones")
        it = doc["item"]
        item = TaskItem(int(it["index"]), str(it["prompt"]), it.get("target"), dict(it.get("meta") or {}))
        g = _make_group(item.index, item, ids, [float(r) for r in doc["rewards"]], rollouts, None,
                        int(doc["requested_version"]), float(doc["requested_at"]), float(doc["finished_at"]),
                        multi_turn=self.multi_turn)
        g.attempt = int(doc.get("attempt") or 0)
        return g

    def read(self, ids: list[tuple[str, str]]) -> list:
        """The group's rollouts, once every replay record is in the store (the engines write them just after a
        request ends)."""
        deadline = time.monotonic() + self.record_timeout_s
        wait = 0.02
        while True:
            try:
                rs = read_rollouts(self.store, self.run_id, trajectories=ids, vocab_size=self.vocab_size)
                break
            except (MissingReplayError, ObjectNotFound) as exc:
                if time.monotonic() > deadline:
                    raise _Failed("replay", f"records still incomplete after {self.record_timeout_s:.0f} s: "
                                            f"{exc}") from exc
                time.sleep(wait)
                wait = min(0.5, wait * 2)
            except (RolloutError, ValueError) as exc:  # mismatched or corrupt records, malformed trajectories
                raise _Failed("replay", f"{type(exc).__name__}: {exc}") from exc
        if len(rs.rollouts) != len(ids) or rs.skipped_failed:
            raise _Failed("record", f"{len(rs.rollouts)} of {len(ids)} trajectories complete")
        return rs.rollouts


def _token_versions(ro) -> list[int]:
    """The weight version of each generated token of a rollout, over its sequences (a compacted request has one
    per context window, its summaries too)."""
    return [int(v) for seq in ro.sequences for v in seq.versions[seq.loss_mask].tolist()]


def _make_group(index, item, ids, rewards, rollouts, counted, version, requested_at, finished_at, *,
                multi_turn: bool = False) -> Group:
    """A group from its read-back rollouts (one sequence each, or one per context window for a compacted request,
    ``syncd.engine.proxy.compaction``, or for a multi-turn episode one per run of turns that extend each other;
    ``counted``: the token counts the responses reported, checked when given: equal, or at most the recorded ones
    when compacted)."""
    versions: dict[int, int] = {}
    tokens, per_token = 0, []
    for j, ro in enumerate(rollouts):
        if len(ro.sequences) != 1 and not ((ro.compaction or multi_turn) and ro.sequences):
            raise _Failed("record", f"trajectory {ro.trajectory_id}: {len(ro.sequences)} sequences, want 1")
        vs = _token_versions(ro)
        n = len(vs)
        if counted is not None and counted[j] >= 0 and (n < counted[j] if ro.compaction else n != counted[j]):
            raise _Failed("record", f"trajectory {ro.trajectory_id}: {n} recorded tokens, the response "
                                    f"counted {counted[j]}")
        per_token.append(vs)
        for v in vs:
            versions[v] = versions.get(v, 0) + 1
        tokens += n
    return Group(index, item, list(ids), list(rewards), rollouts, versions, tokens, version, requested_at,
                 finished_at, per_token)


class _Failed(RuntimeError):
    def __init__(self, kind: str, msg: str):
        super().__init__(msg)
        self.kind = kind
