"""The controller role of a cluster node (:class:`Controller`, held by :class:`~syncd.cluster.node.ClusterNode`):
while a node is the controller it polls the store for new versions, plans every version some live node still
needs (roots, trees, slow nodes at the leaves), and sends each plan with its signed manifest to the nodes in
it, again whenever membership changes. On takeover it continues from shared state, not from its predecessor.
Runs on the node's event loop (store reads and manifest parsing in worker threads).

**Newest means verified.** The poll is the one every reader uses, :class:`syncd.newest.VersionPoller`, over
the controller's :class:`~syncd.manifest_source.ManifestSource` (the daemon's reader of verified manifests): a
version is the run's newest only once its manifest has been read, parsed and (with a key) verified. Each poll
(every ``poll_s``) reads the ``latest.json`` hint with a conditional GET (bounded, strict parse; unsigned, so
only a candidate), probes the versions after the newest one known (so new versions are found under a stale or
forged hint too), and lists the version directories, newest first, when the hint is missing, malformed or
names nothing usable, and every :data:`LIST_EVERY_S` anyway. A candidate without a manifest is not there yet. A
candidate whose manifest does not parse or verify is *unusable*: it is skipped, remembered for the term (not
read again), reported once (event ``bad_version``, an error in the log, ``failures{kind="manifest"}``), and
never a high-water mark -- valid versions below it and after it are still found. The same holds for a version
between two a node needs: it is skipped, not a reason to stop planning. At most :data:`MAX_READS_PER_POLL`
manifests are read per poll by a listing, so a store full of garbage costs bounded work.
"""

from __future__ import annotations

import asyncio
import logging
import time

from syncd import versions
from syncd.cluster import wire
from syncd.cluster.planner import plan_version
from syncd.cluster.wire import T
from syncd.errors import ManifestError, StoreError, VersionNotFound
from syncd.manifest_source import ManifestSource
from syncd.newest import VersionPoller

log = logging.getLogger("syncd.cluster.node")

__all__ = ["Controller", "LIST_EVERY_S", "MAX_READS_PER_POLL"]

#: seconds between listings of the version directories when the hint looks fine
LIST_EVERY_S = 30.0
#: manifests a listing reads per poll at most
MAX_READS_PER_POLL = 64


class Controller:
    """The controller role of ``node`` (see the module docstring); made by :meth:`ClusterNode.start` (on its
    loop). ``latest``: the newest verified version known (None: none yet)."""

    def __init__(self, node):
        self.node = node
        self.latest: int | None = None
        self.source = ManifestSource(node.run_id, store=node.store, cache=node.cache.cache, key=node.key,
                                     retry_failed_s=float("inf"), on_reject=self._unusable)
        self._poller: VersionPoller | None = None
        self._wake = asyncio.Event()
        self._sent: dict[tuple, tuple] = {}
        self._starts: dict[tuple, int] = {}
        self._slow: dict[int, tuple[float, int]] = {}
        self._seq = 0

    def wake(self) -> None:
        """Plan again now (membership changed)."""
        self._wake.set()

    def take_over(self) -> None:
        """This node became the controller: continue from shared state -- the plans this node received (every
        node gets them), each node's delivered version and holdings (heartbeats), the manifests (store)."""
        node = self.node
        self._sent.clear()
        self.source.forget_rejections()
        self._poller = VersionPoller(node.store, node.run_id, read=self.source.get, list_every_s=LIST_EVERY_S,
                                     max_reads=MAX_READS_PER_POLL, retry_s=float("inf"), probe_next=True,
                                     on_skip=lambda v, exc: None,  # the source reports refusals (once)
                                     on_bad_hint=lambda exc: node.events("bad_hint", why=str(exc)[:200]))
        self._poller.newest = self.latest
        for ps in node.plans.values():
            self.source.remember(ps.manifest, ps.raw)
        self._seq = max([ps.plan.seq for ps in node.plans.values()] + [self._seq])
        self._wake.set()

    def heartbeat_fields(self) -> dict:
        """What the controller's heartbeat adds: each new node's start version, the newest verified version."""
        node = self.node
        peers = node.heartbeats.membership.peers
        return {"starts": {str(r): v for (r, inc), v in self._starts.items()
                           if peers.get(r) is not None and peers[r].incarnation == inc},
                "latest": -1 if self.latest is None else self.latest}

    def skipped(self) -> dict[str, str]:
        """``{version: why}`` of the unusable versions skipped this term (newest 16)."""
        return {str(v): why[:500] for v, why in sorted(self.source.rejections().items())[-16:]}

    async def loop(self) -> None:
        """Supervised (:class:`syncd.supervise.Supervisor`): what a step raises restarts the loop."""
        node = self.node
        while node.running:
            if node.heartbeats.election.is_controller:
                await self._control_once()
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), node.cfg.poll_s)
            except asyncio.TimeoutError:
                pass

    # ------------------------------------------------------------------------------------- manifests

    def _unusable(self, v: int, reason: str, exc: BaseException) -> None:
        """A version's manifest was refused (reported once by the source; here: the event and the count)."""
        self.node.events("bad_version", v=v, why=str(exc)[:200])
        self.node.failure("manifest")

    async def _manifest(self, v: int):
        """``(manifest, raw)`` of verified version ``v``. Raises :class:`VersionNotFound`,
        :class:`ManifestError` (unusable, reported the first time), :class:`StoreError`."""
        return await asyncio.to_thread(self.source.entry, v)

    async def _chain_start(self, v: int) -> int:
        """The full version ``v``'s chain starts at (the one chain walk, :func:`syncd.versions.walk_back`)."""
        chain = await asyncio.to_thread(lambda: list(versions.walk_back(self.source.get, v,
                                                                        check=self.source.check_link)))
        return chain[-1].version

    # ------------------------------------------------------------------------------------- polling

    async def _poll_newest(self) -> None:
        """One poll (see the module docstring): raise ``latest`` to the newest verified version found."""
        node = self.node
        if self._poller is None:
            self.take_over()
        try:
            await asyncio.to_thread(self._poller.poll)
        except (StoreError, OSError) as exc:
            log.warning("node %d: polling run %s failed: %s", node.rank, node.run_id, exc)
            node.failure("store")
            return
        found = self._poller.newest
        if found is not None and (self.latest is None or found > self.latest):
            self.latest = found
            node.events("latest", v=found)

    def _slow_set(self, live: list[int]) -> set[int]:
        """Nodes to keep at the leaves. Children report, per parent, the rate they receive at while the
        parent has data ready, and parents that stalled while holding data; a parent far below the
        cluster's median rate, or reported stalled, is slow. Marks last 30 s (plans do not flap), and at
        most a third of the live nodes are slow at once (the most reported first): when everyone looks
        slow, the network is, not the nodes."""
        node = self.node
        now = time.monotonic()
        per_parent: dict[int, list[int]] = {}
        for r in live:
            info = node.heartbeats.membership.info(r) if r != node.rank else node.heartbeats.heartbeat()
            for p, x in (info.get("rates") or {}).items():
                if isinstance(x, int) and x > 0 and isinstance(p, str) and p.isdigit():
                    per_parent.setdefault(int(p), []).append(x)
            for p in info.get("stalled") or []:
                if isinstance(p, int) and p in live and p != r:
                    old = self._slow.get(p, (0.0, 0))
                    self._slow[p] = (now, old[1] + 1 if now - old[0] < 30 else 1)
        med = {p: sorted(xs)[len(xs) // 2] for p, xs in per_parent.items()}
        if len(med) >= 3:
            overall = sorted(med.values())[len(med) // 2]
            for p, x in med.items():
                if x < node.cfg.slow_fraction * overall:
                    old = self._slow.get(p, (0.0, 0))
                    self._slow[p] = (now, old[1] + 1)
        marked = sorted((p for p, (t, _) in self._slow.items() if now - t < 30 and p in live),
                        key=lambda p: (-self._slow[p][1], p))
        return set(marked[:len(live) // 3])

    async def _control_once(self) -> None:
        await self._poll_newest()
        if self.latest is None:
            return
        try:
            await self._plan_all(self.latest)
        except (StoreError, OSError) as exc:
            log.warning("node %d: planning stopped at a store error (next poll retries): %s", self.node.rank, exc)
            self.node.failure("store")

    async def _start_of(self, r: int, inc, latest: int) -> int | None:
        """The version a node without history starts at (the full version under ``latest``, fixed per
        incarnation), or None while ``latest``'s chain cannot be walked (reported)."""
        if (r, inc) not in self._starts:
            try:
                self._starts[(r, inc)] = await self._chain_start(latest)
            except (VersionNotFound, ManifestError) as exc:
                log.warning("node %d: no start version for rank %d yet: the chain of version %d is broken: %s",
                            self.node.rank, r, latest, exc)
                return None
        return self._starts[(r, inc)]

    async def _plan_all(self, latest: int) -> None:
        node = self.node
        live = node.heartbeats.membership.live()
        nxt: dict[int, int] = {}
        delivered: dict[int, int] = {}
        for r in live:
            info = node.heartbeats.heartbeat() if r == node.rank else node.heartbeats.membership.info(r)
            inc = node.inc if r == node.rank else info.get("inc")
            d, s = info.get("delivered", -1), info.get("start", -1)
            delivered[r] = d
            if d >= 0 and d + 1 <= latest:
                try:
                    await self._manifest(d + 1)
                    nxt[r] = d + 1
                except (VersionNotFound, ManifestError):  # gone (retention) or unusable: the newest full one
                    start = await self._start_of(r, inc, latest)
                    if start is not None:
                        nxt[r] = start
            elif d >= 0:
                nxt[r] = d + 1
            elif s >= 0:
                nxt[r] = s
            else:
                start = await self._start_of(r, inc, latest)
                if start is not None:
                    nxt[r] = start
            if r == node.rank and d < 0 and r in nxt and node.adopt_start(nxt[r]):
                node.pulse()
        if not nxt:
            return
        lo = min(nxt.values())
        slow = self._slow_set(live)
        for v in range(lo, latest + 1):
            if not node.heartbeats.election.is_controller:
                return  # deposed (or the etcd lease ran out) while planning: send nothing more
            try:
                m, raw = await self._manifest(v)
            except (VersionNotFound, ManifestError):
                continue
            needers = {r for r in nxt if nxt[r] <= v}
            if not needers:
                continue
            holders: dict[str, set[int]] = {}
            partial: dict[str, dict[int, int]] = {}
            for r in live:
                if delivered[r] >= v:
                    for s in m.shards:
                        holders.setdefault(s.sha256, set()).add(r)
                theirs = node.relay.partial() if r == node.rank else node.heartbeats.membership.info(r).get("part")
                part = theirs or {}
                for s in m.shards:
                    n = part.get(s.sha256)
                    if isinstance(n, int) and not isinstance(n, bool) and 0 < n < s.size:
                        partial.setdefault(s.sha256, {})[r] = n
            for s in m.shards:
                for r in node.relay.holders(s.sha256) if v in node.plans else ():
                    holders.setdefault(s.sha256, set()).add(r)
                if node.cache.has(s.sha256):
                    holders.setdefault(s.sha256, set()).add(node.rank)
            prev = node.plans.get(v)
            cand = plan_version(m, live=live, needers=needers, holders=holders, partial=partial,
                                prev=prev.plan if prev is not None else None, slow=slow, fanout=node.cfg.fanout,
                                chunk_bytes=node.cfg.chunk_bytes, store_streams=node.cfg.store_streams,
                                term=node.heartbeats.election.term, seq=self._seq + 1)
            if prev is None or prev.plan.key() != cand.key():
                self._seq += 1
                node.accept_plan(cand, m, raw)
                plan = cand
            else:
                plan = prev.plan
            payload = None
            for r in plan.members:
                if r == node.rank or r not in live or not node.heartbeats.election.is_controller:
                    continue
                inc = node.heartbeats.membership.info(r).get("inc")
                if self._sent.get((r, inc, v)) == plan.key():
                    continue
                if payload is None:
                    payload = wire.dump_json({"plan": plan.to_json(), "manifest": raw.decode("ascii")})
                if await node.heartbeats.send(r, T.PLAN, payload):
                    self._sent[(r, inc, v)] = plan.key()
        for k in [k for k in self._sent if k[2] < lo]:
            del self._sent[k]
        self.source.forget_below(lo)
