"""Planning one version's distribution: a root per shard and a broadcast tree per shard.

Pure functions of their inputs (no I/O, no clock, no randomness): the same inputs give the same plan on
every node, so a controller that takes over recomputes what its predecessor would have.

* **Roots** (the node that reads the shard from the store, or, for a catch-up, serves it from its cache):
  a root of the previous plan that is still live (and not slow) keeps its shards (*stable*: a membership
  change moves only the shards of the nodes that left). Every other shard, largest first, goes to the
  least-loaded node by bytes -- among live, not-slow nodes that already hold it, if any (no store read at
  all); else to the live, not-slow node holding the longest verified prefix of it, if any (a root that
  died mid-broadcast: its successor reads only the rest from the store); else among the live members that
  are not marked slow. This is LPT scheduling: no root gets more than the mean plus one shard.
* **Trees**: the members of a version are the live nodes that need it (plus the roots). The tree of a shard
  lists the root first, then the other members, slow nodes last; position ``p``'s parent is
  ``(p - 1) // fanout``. Trees are built largest shard first, and the interior positions of each go to the
  members with the least upload assigned so far (bytes times children), so the upload of all trees
  together is spread evenly and different trees have different interior nodes; slow nodes at the end are
  leaves whenever there are enough leaf positions.
* **Fetch order**: largest shard first. With ``store_streams`` = M > 0 the roots pace their store reads by
  it (``ClusterNode``): at most M shards are read from the store at once, cluster-wide, the largest first,
  and the last to leave the store is a small one. M = 0 (the default) does not pace: streaming roots read
  at once and the store link is shared by all of them.

Plans travel as JSON (:meth:`Plan.to_json`); :func:`Plan.from_json` checks a received plan against the
manifest it comes with and raises :class:`~syncd.cluster.errors.ProtocolError` for anything inconsistent.
"""

from __future__ import annotations

from dataclasses import dataclass

from syncd import manifest as mf
from syncd.cluster.errors import ProtocolError

MAX_RANK = (1 << 31) - 1
MAX_FANOUT = 64


@dataclass(frozen=True)
class ShardPlan:
    """One shard: its manifest index, content hash and size, its ``root`` and tree ``order`` (root first)."""

    index: int
    sha256: str
    size: int
    root: int
    order: tuple[int, ...]
    fetch_rank: int

    def parent(self, rank: int, fanout: int) -> int | None:
        p = self.order.index(rank)
        return None if p == 0 else self.order[(p - 1) // fanout]

    def ancestors(self, rank: int, fanout: int) -> list[int]:
        """The chain from ``rank``'s parent up to the root (empty for the root)."""
        out, p = [], self.order.index(rank)
        while p > 0:
            p = (p - 1) // fanout
            out.append(self.order[p])
        return out

    def children(self, rank: int, fanout: int) -> list[int]:
        p = self.order.index(rank)
        return list(self.order[p * fanout + 1:p * fanout + 1 + fanout])


@dataclass(frozen=True)
class Plan:
    """The distribution plan of one version. ``term``/``seq`` order plans: a node follows the plan with
    the highest ``(term, seq)`` for a version. ``members``: every node in the trees."""

    version: int
    term: int
    seq: int
    fanout: int
    chunk_bytes: int
    store_streams: int
    members: tuple[int, ...]
    slow: tuple[int, ...]
    shards: tuple[ShardPlan, ...]

    def key(self) -> tuple:
        """What makes two plans different for the nodes (everything but term and seq)."""
        return (self.version, self.fanout, self.chunk_bytes, self.store_streams, self.members, self.slow,
                tuple((s.root, s.order) for s in self.shards))

    def roots(self) -> dict[int, int]:
        """Bytes each root reads (or serves as root)."""
        out: dict[int, int] = {}
        for s in self.shards:
            out[s.root] = out.get(s.root, 0) + s.size
        return out

    def to_json(self) -> dict:
        return {"version": self.version, "term": self.term, "seq": self.seq, "fanout": self.fanout,
                "chunk_bytes": self.chunk_bytes, "store_streams": self.store_streams,
                "members": list(self.members), "slow": list(self.slow),
                "roots": [s.root for s in self.shards], "orders": [list(s.order) for s in self.shards],
                "fetch": [s.fetch_rank for s in self.shards]}

    @classmethod
    def from_json(cls, obj: dict, m: mf.Manifest, *, max_chunk_bytes: int) -> "Plan":
        """A received plan for manifest ``m`` (already verified). Raises :class:`ProtocolError`."""
        def integer(v, what, lo, hi):
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                raise ProtocolError(f"plan: {what} must be an integer in {lo}..{hi}, got {v!r:.40}")
            return v

        def ranks(v, what):
            if not isinstance(v, list) or len(v) > 1 << 16:
                raise ProtocolError(f"plan: {what} must be a list of ranks")
            return tuple(integer(r, what, 0, MAX_RANK) for r in v)

        need = {"version", "term", "seq", "fanout", "chunk_bytes", "store_streams", "members", "slow", "roots",
                "orders", "fetch"}
        if not isinstance(obj, dict) or set(obj) != need:
            raise ProtocolError("plan: wrong set of members")
        if obj["version"] != m.version:
            raise ProtocolError(f"plan is for version {obj['version']!r:.20}, its manifest for {m.version}")
        members = ranks(obj["members"], "members")
        if len(set(members)) != len(members) or not members:
            raise ProtocolError("plan: members must be distinct and non-empty")
        n = len(m.shards)
        roots, orders, fetch = obj["roots"], obj["orders"], obj["fetch"]
        if not all(isinstance(x, list) and len(x) == n for x in (roots, orders, fetch)):
            raise ProtocolError(f"plan: roots, orders and fetch must have one entry per shard ({n})")
        if sorted(integer(f, "fetch", 0, n - 1) for f in fetch) != list(range(n)):
            raise ProtocolError("plan: fetch ranks must be a permutation of the shards")
        mset = set(members)
        shards = []
        for i, s in enumerate(m.shards):
            order = ranks(orders[i], "order")
            root = integer(roots[i], "root", 0, MAX_RANK)
            if not order or order[0] != root or len(set(order)) != len(order) or not set(order) <= mset:
                raise ProtocolError(f"plan: tree of shard {i} is not a list of distinct members rooted at its root")
            shards.append(ShardPlan(i, s.sha256, s.size, root, order, fetch[i]))
        return cls(m.version, integer(obj["term"], "term", 0, 1 << 62), integer(obj["seq"], "seq", 0, 1 << 62),
                   integer(obj["fanout"], "fanout", 1, MAX_FANOUT),
                   integer(obj["chunk_bytes"], "chunk_bytes", 4096, max_chunk_bytes),
                   integer(obj["store_streams"], "store_streams", 0, 1 << 16), members,
                   ranks(obj["slow"], "slow"), tuple(shards))


def plan_version(m: mf.Manifest, *, live, needers, holders=None, partial=None, prev: Plan | None = None, slow=(),
                 fanout: int = 2, chunk_bytes: int = 1 << 20, store_streams: int = 0, term: int = 0,
                 seq: int = 0) -> Plan:
    """The plan of version ``m`` (see the module docstring).

    ``live``: ranks currently alive. ``needers``: live ranks that still need this version. ``holders``:
    ``{sha256: ranks holding that shard complete}``. ``partial``: ``{sha256: {rank: verified bytes}}`` of
    shards some nodes hold in part. ``prev``: this version's previous plan (for
    stability). ``slow``: ranks to keep at the leaves and away from roots. Raises ``ValueError`` if no live
    node can be a root (``live`` is empty)."""
    if fanout < 1:
        raise ValueError("fanout must be at least 1")
    live = sorted(set(live))
    if not live:
        raise ValueError("no live node to plan for")
    liveset, slowset = set(live), set(slow) & set(live)
    holders, partial = holders or {}, partial or {}
    members = set(needers) & liveset
    if prev is not None:
        members |= set(prev.members) & liveset
    load = {r: 0 for r in live}
    roots: dict[int, int] = {}
    prev_roots = {s.index: s.root for s in prev.shards} if prev is not None else {}
    by_size = sorted(range(len(m.shards)), key=lambda i: (-m.shards[i].size, i))
    for i in by_size:  # keep the live roots of the previous plan first, so the load below counts them
        r = prev_roots.get(i)
        if r is not None and r in liveset and r not in slowset:
            roots[i] = r
            load[r] += m.shards[i].size
    fresh = [r for r in sorted(members) if r not in slowset] or sorted(members) or live
    for i in by_size:
        if i in roots:
            continue
        sha = m.shards[i].sha256
        cands = sorted(set(holders.get(sha, ())) & liveset - slowset)
        prefix = {r: n for r, n in partial.get(sha, {}).items() if r in liveset - slowset and n > 0}
        if not cands and prefix:
            roots[i] = max(sorted(prefix), key=lambda r: (prefix[r], -load[r]))  # the longest prefix
        else:
            cands = cands or fresh
            # least loaded; ties broken by a rotation by shard index and version, so equal loads do not all
            # pick rank 0 (the controller, as a rule), nor every one-shard version the same root
            turn = i + m.version
            roots[i] = min(cands, key=lambda r: (load[r], (cands.index(r) - turn) % len(cands)))
        load[roots[i]] += m.shards[i].size
    members |= set(roots.values())
    # fetch order: largest first (the longest reads start at once; the small ones fill in, and the last
    # shard to leave the store is a small one, so the broadcast's tail after the last store byte is short)
    fetch_rank = {i: q for q, i in enumerate(by_size)}
    ordered_members = sorted(members)
    # trees, largest shard first: interior positions go to the nodes with the least upload so far
    nmem = len(ordered_members)
    upload = {r: 0 for r in ordered_members}
    for i, r in roots.items():  # a root sends every byte of its shard to its own children
        upload[r] += m.shards[i].size * min(fanout, nmem - 1)
    orders: dict[int, tuple[int, ...]] = {}
    for i in by_size:
        size, root = m.shards[i].size, roots[i]
        others = [r for r in ordered_members if r != root]
        fast = sorted((r for r in others if r not in slowset),
                      key=lambda r: (upload[r], (ordered_members.index(r) - fetch_rank[i]) % nmem))
        order = (root, *fast, *sorted(r for r in others if r in slowset))
        for p, r in enumerate(order[1:], 1):
            kids = max(0, min(fanout, len(order) - (p * fanout + 1)))
            upload[r] += size * kids
        orders[i] = order
    shards = tuple(ShardPlan(i, s.sha256, s.size, roots[i], orders[i], fetch_rank[i]) for i, s in enumerate(m.shards))
    return Plan(m.version, term, seq, fanout, chunk_bytes, store_streams, tuple(ordered_members),
                tuple(sorted(slowset)), shards)
