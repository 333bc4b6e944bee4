"""Reading rollouts back: the proxy's trajectory records joined with the engines' replay records into
training-ready tensors (``docs/trainer-replay.md``).

    rs = read_rollouts("s3://bucket/rl", "run-42")          # every trajectory of the run
    for rollout in rs.rollouts:
        for seq in rollout.sequences: ...                   # tokens, loss mask, versions, log-probs, kept, routes
    batch = collate([s for r in rs.rollouts for s in r.sequences])

A trajectory record lists its turns; each turn names the engine request id of every segment that produced it
(several when Dynamo migrated the request to another worker). The replay records of a request may come from
several writers and segments: a segment's tokens are the records of the engine run that started at that
segment (``position - index`` equals the segment's first position; a killed worker's extra tokens are ignored).
Every generated token must have its record, agreeing with the trajectory on token id, weight version and
log-probability (finite in both: a NaN or +-inf log-prob or temperature is a :class:`NonFiniteError`, so one
poisoned record costs its group, never the run); its kept set must contain it (a set recorded to be rebuilt from the
trainer's logits is checked when it is rebuilt, :mod:`syncd.trainer.rl.kept`); MoE routes must fit the model (ids ``< E``, distinct per position);
segments must follow each other without a gap. Otherwise a named :class:`RolloutError` is raised (or, with
``on_error="drop"``, the trajectory is dropped and counted by reason): never a silent zero.

Routes ``[T, L, k]`` (compact dtype, :data:`syncd.ops.replay.NO_ROUTE` where none): the routes of position ``q``
come from the engine run whose logits at ``q`` sampled the next token, else from the first prefill that ran ``q``
(the prompt). ``row_versions`` follow the same rule. Other runs that ran ``q`` again (a migrated request's re-prefill, a later turn's prompt) are
compared and their disagreements counted (``route_conflicts``). The last position of a sequence was never run.

Consecutive turns whose prompt extends the previous turn's prompt and output, at the same temperature, are
merged into one sequence (``merge_turns``); otherwise a trajectory has one sequence per turn. Failed turns are not used; failed
trajectories are skipped unless ``include_failed`` (their ``ok`` turns are then read).

Thread-safety: none needed; every call reads the store afresh.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from syncd.errors import ObjectNotFound, SyncdError
from syncd.ops.replay import NO_ROUTE, route_dtype
from syncd.records.replay import KeptToRebuild, ReplayFormatError
from syncd.records.replay_store import read_request
from syncd.records.trajectory import RecordError, list_records, read_record
from syncd.store import Store

log = logging.getLogger(__name__)

__all__ = ["read_rollouts", "RolloutSet", "Rollout", "RolloutSequence", "PendingKept", "RolloutError",
           "SegmentGapError", "MissingReplayError", "RecordMismatchError", "KeptSetError", "RouteError",
           "NonFiniteError", "UnpublishedVersionError", "NO_VERSION"]

#: the version of a position that is not a generated token (or was sampled with weights of no published version)
NO_VERSION = -1
LOGPROB_TOLERANCE = 1e-5


class RolloutError(SyncdError, ValueError):
    """A trajectory cannot be turned into training data as recorded."""


class SegmentGapError(RolloutError):
    """A turn's segments do not follow each other from its first output token to its last."""


class MissingReplayError(RolloutError):
    """A generated token (or a prompt position of an MoE model) has no replay record."""


class RecordMismatchError(RolloutError):
    """The replay records and the trajectory record disagree (token id, version, log-prob, vocabulary)."""


class NonFiniteError(RolloutError):
    """A record holds a NaN or +-inf where a finite number is needed (a log-prob, a sampling temperature)."""


class UnpublishedVersionError(RolloutError):
    """A record claims a weight version that was never published: newer than the trainer's newest, or none at all
    (:data:`NO_VERSION`: an engine on weights of no version of the run)."""


class KeptSetError(RolloutError):
    """A recorded kept set does not contain the token that was sampled from it."""


class RouteError(RolloutError):
    """Recorded MoE routes do not fit the model (ids >= E, repeated experts, other layers or top_k)."""


@dataclass
class PendingKept:
    """Kept sets recorded to be rebuilt from logits (``docs/replay-format.md``, format 2), for ``R`` generated
    tokens: ``rows`` (int64 ``[R]``, indices into the generated tokens, i.e. rows of the kept-set CSR, where those
    rows are still empty), each set the first ``top`` ranks of the sampling logits and the ``extra_ids`` (CSR
    ``extra_offsets``), verified by ``fingerprints``; ``tolerances``: the engines' ``delta``. Rebuilt by
    :func:`syncd.trainer.rl.kept.fill_kept`."""

    rows: torch.Tensor
    top: torch.Tensor
    extra_ids: torch.Tensor
    extra_offsets: torch.Tensor
    fingerprints: torch.Tensor
    tolerances: torch.Tensor

    def __len__(self) -> int:
        return int(self.rows.numel())

    def to(self, device) -> "PendingKept":
        return PendingKept(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))

    @staticmethod
    def of(rows: list[int], sets: list[KeptToRebuild]) -> "PendingKept | None":
        if not rows:
            return None
        sizes = torch.tensor([k.extra.size for k in sets], dtype=torch.int64)
        extra = np.concatenate([k.extra for k in sets]).astype(np.int64)
        return PendingKept(torch.tensor(rows, dtype=torch.int64),
                           torch.tensor([k.top for k in sets], dtype=torch.int64), torch.from_numpy(extra),
                           torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)]),
                           torch.tensor([k.fingerprint for k in sets], dtype=torch.int64),
                           torch.tensor([k.tolerance for k in sets], dtype=torch.float32))

    @staticmethod
    def cat(parts: list[tuple["PendingKept | None", int]]) -> "PendingKept | None":
        """One of several, ``(pending, row offset)`` each (the offset of its rows among all generated tokens)."""
        parts = [(p, off) for p, off in parts if p is not None]
        if not parts:
            return None
        extra_sizes = torch.cat([p.extra_offsets[1:] - p.extra_offsets[:-1] for p, _ in parts])
        return PendingKept(torch.cat([p.rows + off for p, off in parts]), torch.cat([p.top for p, _ in parts]),
                           torch.cat([p.extra_ids for p, _ in parts]),
                           torch.cat([torch.zeros(1, dtype=torch.int64), extra_sizes.cumsum(0)]),
                           torch.cat([p.fingerprints for p, _ in parts]), torch.cat([p.tolerances for p, _ in parts]))


@dataclass
class RolloutSequence:
    """One training sequence (``T`` positions). ``loss_mask``: generated tokens; ``versions``/``logprobs``: the
    weight version each generated token was sampled with and its log-prob under the sampling distribution
    (:data:`NO_VERSION` and 0 elsewhere); ``positions``: the generated tokens' positions, in order, which are the
    rows of the kept sets (CSR ``kept_ids``/``kept_offsets``, ascending ids); ``row_versions``: the version the
    engine ran each position with (:data:`NO_VERSION` where it never ran); ``routes``: ``[T, L, k]`` or None for a
    dense model. ``kept_pending``: the kept sets recorded to be rebuilt from logits (their CSR rows are empty until
    then; :mod:`syncd.trainer.rl.kept`), None when every set was listed."""

    tokens: torch.Tensor
    loss_mask: torch.Tensor
    versions: torch.Tensor
    logprobs: torch.Tensor
    positions: torch.Tensor
    kept_ids: torch.Tensor
    kept_offsets: torch.Tensor
    row_versions: torch.Tensor
    routes: torch.Tensor | None
    vocab_size: int
    num_experts: int
    turns: list[int]
    request_ids: list[str]
    temperature: float = 1.0
    route_conflicts: int = 0
    kept_pending: PendingKept | None = None

    def __len__(self) -> int:
        return int(self.tokens.numel())


@dataclass
class Rollout:
    run_id: str
    sandbox_id: str
    trajectory_id: str
    status: str
    metadata: dict
    sequences: list[RolloutSequence]
    #: turn index -> the turn's ``compaction`` member, for the segments of compacted requests
    #: (syncd.trainer.rl.compaction)
    compaction: dict = field(default_factory=dict)


@dataclass
class RolloutSet:
    """What :func:`read_rollouts` read: ``dropped`` counts trajectories dropped by reason (error class name),
    ``errors`` holds ``(sandbox_id, trajectory_id, message)`` of each, ``skipped_failed`` the failed ones skipped."""

    rollouts: list[Rollout] = field(default_factory=list)
    dropped: Counter = field(default_factory=Counter)
    errors: list = field(default_factory=list)
    skipped_failed: int = 0

    @property
    def sequences(self) -> list[RolloutSequence]:
        return [s for r in self.rollouts for s in r.sequences]


class _Builder:
    """Accumulates one sequence from the turns that extend it."""

    def __init__(self, where: str):
        self.where = where
        self.tokens: list[int] = []
        self.gen: dict[int, tuple] = {}  # position -> (version, logprob, kept ids)
        self.row_version: dict[int, int] = {}  # first writer wins: the run that sampled there, else the first prefill
        self.sampled: dict[int, np.ndarray] = {}  # row -> [L, k] of the run whose logits there sampled a token
        self.prefill: dict[int, np.ndarray] = {}  # row -> [L, k] of the first prefill that ran it
        self.conflicts = 0  # rows some later run routed otherwise
        self.vocab = 0
        self.experts = 0
        self.turns: list[int] = []
        self.request_ids: list[str] = []
        self.temperature: float | None = None

    def extends(self, prompt: list[int], temperature: float) -> bool:
        return bool(self.tokens) and prompt[:len(self.tokens)] == self.tokens and temperature == self.temperature

    def add_route(self, table: dict, row: int, routes: np.ndarray) -> None:
        have = table.get(row)
        if have is None:
            table[row] = routes
        else:
            self.conflicts += int(not np.array_equal(have, routes))

    def route_rows(self) -> dict[int, np.ndarray]:
        rows = dict(self.prefill)
        for q, r in self.sampled.items():
            if q in rows:
                self.conflicts += int(not np.array_equal(rows[q], r))
            rows[q] = r
        return rows


def _temperature(turn: dict, where: str) -> float:
    """The sampling temperature the client asked for (the engines' default 1.0 when absent; greedy turns keep
    one token per kept set, whose log-prob is 0 at any temperature)."""
    t = (turn.get("request") or {}).get("temperature")
    if isinstance(t, float) and not math.isfinite(t):
        _fail(NonFiniteError, where, f"turn {turn.get('index')}: the request's temperature is {t}")
    return 1.0 if t is None or not isinstance(t, (int, float)) or t <= 0 else float(t)


def _fail(kind, where: str, msg: str):
    raise kind(f"{where}: {msg}")


def _turn(b: _Builder, store, run_id: str, turn: dict, chunks_of, vocab_size, num_experts) -> None:
    where = f"{b.where} turn {turn['index']}"
    prompt, out = list(turn["prompt_token_ids"]), list(turn["output_token_ids"])
    p = len(prompt)
    segs = turn["segments"]
    at = 0
    for s in segs:
        if not isinstance(s, dict) or s.get("start") != at or not isinstance(s.get("request_id"), str) \
                or not isinstance(s.get("count"), int) or s["count"] < 1:
            _fail(SegmentGapError, where, f"segment {s!r} does not start at output token {at}")
        at += s["count"]
    if at != len(out):
        _fail(SegmentGapError, where, f"segments cover {at} of {len(out)} output tokens")
    b.tokens = prompt + out
    b.turns.append(turn["index"])
    b.temperature = _temperature(turn, b.where)
    for s in segs:
        rid, origin = s["request_id"], p + s["start"]
        recs, prompt_routes = {}, []
        for c in chunks_of(rid):
            if b.vocab and c.vocab_size != b.vocab:
                _fail(RecordMismatchError, where, f"records of vocabulary {c.vocab_size} and {b.vocab}")
            b.vocab = c.vocab_size
            if c.num_experts:
                if b.experts and c.num_experts != b.experts:
                    _fail(RouteError, where, f"records with {c.num_experts} and {b.experts} experts")
                b.experts = c.num_experts
            if c.records[0].position - c.records[0].index != origin:
                continue  # another engine run of this request (a killed worker, another segment)
            for r in c.records:
                recs[r.position] = r
            if c.prompt_routing is not None:
                prompt_routes.append((c.prompt_routing_start, c.prompt_routing))
        if rid not in b.request_ids:
            b.request_ids.append(rid)
        first_version = None
        for i in range(s["start"], s["start"] + s["count"]):
            pos = p + i
            r = recs.get(pos)
            if r is None:
                _fail(MissingReplayError, where, f"output token {i} (position {pos}) has no replay record from the "
                      f"engine run of request {rid!r} that generated it")
            want_v = turn["versions"][i]
            if r.token_id != out[i] or r.version != want_v:
                _fail(RecordMismatchError, where, f"position {pos}: the replay record has token {r.token_id} of "
                      f"version {r.version}, the trajectory token {out[i]} of version {want_v}")
            lp = turn["logprobs"][i] if i < len(turn.get("logprobs") or []) else None
            if not math.isfinite(r.logprob) or (isinstance(lp, float) and not math.isfinite(lp)):
                _fail(NonFiniteError, where, f"position {pos}: log-prob {r.logprob} in the replay record, {lp} in "
                      "the trajectory: a log-prob must be finite")
            if lp is not None and abs(float(lp) - r.logprob) > LOGPROB_TOLERANCE * max(1.0, abs(r.logprob)):
                _fail(RecordMismatchError, where, f"position {pos}: log-prob {r.logprob} in the replay record, "
                      f"{lp} in the trajectory")
            if not isinstance(r.kept, KeptToRebuild):  # (a set to rebuild is checked when it is rebuilt)
                k = int(np.searchsorted(r.kept, r.token_id))
                if k >= r.kept.size or int(r.kept[k]) != r.token_id:
                    _fail(KeptSetError, where, f"position {pos}: the kept set ({r.kept.size} ids) does not contain "
                          f"the sampled token {r.token_id}")
            version = NO_VERSION if r.version is None else r.version
            first_version = version if first_version is None else first_version
            b.gen[pos] = (version, r.logprob, r.kept)
            b.row_version.setdefault(pos - 1, version)
            if b.experts:
                if r.routing is None:
                    _fail(MissingReplayError, where, f"position {pos}: an MoE record without routes")
                b.add_route(b.sampled, pos - 1, r.routing)
        for q in range(origin - 1):  # this run's prefill ran the positions before its first token's
            b.row_version.setdefault(q, first_version)
        for start, pr in prompt_routes:
            for j in range(pr.shape[0]):
                b.add_route(b.prefill, start + j, pr[j])
    if vocab_size is not None and b.vocab and b.vocab != vocab_size:
        _fail(RecordMismatchError, where, f"records of vocabulary {b.vocab}, the model has {vocab_size}")
    if num_experts is not None and b.experts and b.experts != num_experts:
        _fail(RouteError, where, f"records route among {b.experts} experts, the model has {num_experts}")


def _finish(b: _Builder) -> RolloutSequence:
    T = len(b.tokens)
    tokens = torch.tensor(b.tokens, dtype=torch.int64)
    gen = sorted(b.gen)
    mask = torch.zeros(T, dtype=torch.bool)
    versions = torch.full((T,), NO_VERSION, dtype=torch.int64)
    logprobs = torch.zeros(T, dtype=torch.float32)
    positions = torch.tensor(gen, dtype=torch.int64)
    if gen:
        mask[positions] = True
        versions[positions] = torch.tensor([b.gen[q][0] for q in gen])
        logprobs[positions] = torch.tensor([b.gen[q][1] for q in gen], dtype=torch.float32)
    kept = [b.gen[q][2] for q in gen]
    later = [j for j, k in enumerate(kept) if isinstance(k, KeptToRebuild)]
    listed = [np.zeros(0, dtype=np.int64) if isinstance(k, KeptToRebuild) else k for k in kept]
    sizes = torch.tensor([k.size for k in listed], dtype=torch.int64)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)])
    ids = torch.from_numpy(np.concatenate(listed).astype(np.int32)) if kept else torch.zeros(0, dtype=torch.int32)
    row_versions = torch.full((T,), NO_VERSION, dtype=torch.int64)
    for q, v in b.row_version.items():
        if 0 <= q < T and v is not None:
            row_versions[q] = v
    if T and (int(tokens.min()) < 0 or int(tokens.max()) >= b.vocab > 0):
        _fail(RecordMismatchError, b.where, f"token ids {int(tokens.min())}..{int(tokens.max())} outside the "
              f"vocabulary of {b.vocab}")
    routes = None
    if b.experts:
        rows = b.route_rows()
        shapes = {r.shape for r in rows.values()}
        if len(shapes) != 1:
            _fail(RouteError, b.where, f"routes of several shapes {sorted(shapes)} (layers, top_k)")
        routes = torch.full((T, *shapes.pop()), NO_ROUTE, dtype=route_dtype(b.experts))
        for q, r in rows.items():
            if 0 <= q < T:
                routes[q] = torch.from_numpy(r.astype(np.int64))
        srt = routes.sort(dim=-1).values
        twice = ((srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)).any(-1).any(-1)
        if bool(twice.any()):
            _fail(RouteError, b.where, f"position {int(torch.nonzero(twice)[0])}: an expert appears twice in one "
                  "layer's routes")
        missing = torch.nonzero(routes[:T - 1, 0, 0] == NO_ROUTE)
        if missing.numel():
            _fail(MissingReplayError, b.where, f"{missing.numel()} position(s) have no routes (first: "
                  f"{int(missing[0])})")
    return RolloutSequence(tokens, mask, versions, logprobs, positions, ids, offsets, row_versions, routes, b.vocab,
                           b.experts, b.turns, b.request_ids, b.temperature, b.conflicts,
                           PendingKept.of(later, [kept[j] for j in later]))


def _trajectory(store, run_id: str, doc: dict, *, merge_turns: bool, vocab_size, num_experts) -> list[RolloutSequence]:
    cache: dict[str, list] = {}

    def chunks_of(rid: str):
        if rid not in cache:
            cache[rid] = read_request(store, run_id, rid)
        return cache[rid]

    where = f"trajectory {doc['sandbox_id']}/{doc['trajectory_id']}"
    seqs, b = [], None
    for turn in doc["turns"]:
        if turn["status"] != "ok":
            continue
        if b is None or not (merge_turns and b.extends(list(turn["prompt_token_ids"]), _temperature(turn, where))):
            if b is not None:
                seqs.append(_finish(b))
            b = _Builder(where)
        _turn(b, store, run_id, turn, chunks_of, vocab_size, num_experts)
    if b is not None:
        seqs.append(_finish(b))
    return seqs


def read_rollouts(store, run_id: str, *, sandbox_id: str | None = None, trajectories=None, on_error: str = "raise",
                  include_failed: bool = False, merge_turns: bool = True, vocab_size: int | None = None,
                  num_experts: int | None = None) -> RolloutSet:
    """Every trajectory of ``run_id`` (of one sandbox, or the ``(sandbox_id, trajectory_id)`` pairs given) as
    :class:`Rollout` s. ``vocab_size``/``num_experts``: the trainer model's, checked against the records.

    ``on_error="raise"`` (default) raises the first :class:`RolloutError`, ``ReplayFormatError`` (a corrupt
    replay chunk), ``RecordError`` (a malformed trajectory record) or ``ObjectNotFound``; ``"drop"`` drops that
    trajectory and counts it in :attr:`RolloutSet.dropped`."""
    if on_error not in ("raise", "drop"):
        raise ValueError("on_error must be 'raise' or 'drop'")
    store = Store.open(store)
    ids = list(trajectories) if trajectories is not None else list_records(store, run_id, sandbox_id)
    out = RolloutSet()
    for sb, tid in ids:
        try:
            doc = read_record(store, run_id, sb, tid)
            if doc["status"] != "complete" and not include_failed:
                out.skipped_failed += 1
                continue
            seqs = _trajectory(store, run_id, doc, merge_turns=merge_turns, vocab_size=vocab_size,
                               num_experts=num_experts)
        except (RolloutError, ReplayFormatError, RecordError, ObjectNotFound) as exc:
            if on_error == "raise":
                raise
            out.dropped[type(exc).__name__] += 1
            out.errors.append((sb, tid, str(exc)))
            log.warning("dropped trajectory %s/%s: %s", sb, tid, exc)
            continue
        out.rollouts.append(Rollout(run_id, sb, tid, doc["status"], doc.get("metadata") or {}, seqs,
                                    {t["index"]: t["compaction"] for t in doc["turns"] if t.get("compaction")}))
    return out
