"""The controller's side of a cluster node (part of :class:`syncd.cluster.node.ClusterNode`): while a node is the
controller it polls the store for new versions, plans every version some live node still needs (roots,
trees, slow nodes at the leaves), and sends each plan with its signed manifest to the nodes in it, again
whenever membership changes. On takeover it continues from shared state, not from its predecessor. Runs on
the node's event loop (store reads and manifest parsing in worker threads).

**Newest means verified.** The controller takes a version as the run's newest only once it has read,
parsed and (with a key) verified that version's manifest itself. Each poll (every ``poll_s``) it reads the
``latest.json`` hint with a conditional GET (bounded, strict parse; the hint is unsigned, so only a
candidate), probes the version after the newest one it knows (so new versions are found under a stale or
forged hint too), and lists the version directories, newest first, when the hint is missing, malformed or
names nothing usable, and every :data:`LIST_EVERY_S` anyway. A candidate without a manifest is not there
yet. A candidate whose manifest does not parse or verify is *unusable*: it is skipped, remembered (not read
again this term), reported (event ``bad_version``, an error in the log, ``failures{kind="manifest"}``), and
never a high-water mark -- valid versions below it and after it are still found. The same holds for a
version between two a node needs: it is skipped, not a reason to stop planning. At most
:data:`MAX_READS_PER_POLL` manifests are read per poll, so a store full of garbage costs bounded work.
"""

from __future__ import annotations

import asyncio
import logging
import time

from syncd import manifest as mf
from syncd.cluster import wire
from syncd.cluster.errors import ProtocolError
from syncd.cluster.planner import plan_version
from syncd.cluster.wire import T
from syncd.errors import ObjectNotFound, StoreError, SyncdError, VersionNotFound

log = logging.getLogger("syncd.cluster.node")

#: seconds between listings of the version directories when the hint looks fine
LIST_EVERY_S = 30.0
#: manifests read per poll at most (new candidates and probes)
MAX_READS_PER_POLL = 64
#: the largest ``latest.json`` hint read
HINT_MAX_BYTES = 4096


class UnusableVersion(SyncdError, ValueError):
    """A version's manifest exists but does not parse or verify; the version is skipped."""


class ControllerRole:
    """Mixin of :class:`~syncd.cluster.node.ClusterNode`: what it does while it is the controller."""

    def _rebuild_controller_state(self) -> None:
        """On takeover: continue from shared state -- the plans this node received (every node gets
        them), each node's delivered version and holdings (heartbeats), the manifests (store)."""
        self._sent.clear()
        self._etag = None
        self._listed_at = float("-inf")
        self._bad.clear()
        for v, ps in self.plans.items():
            self._manifests.setdefault(v, (ps.raw, ps.manifest))
        self._seq = max([ps.plan.seq for ps in self.plans.values()] + [self._seq])

    async def _controller_loop(self) -> None:
        """Supervised (:class:`syncd.supervise.Supervisor`): what a step raises restarts the loop."""
        while self._running:
            if self.is_controller:
                await self._control_once()
            self._ctrl_wake.clear()
            try:
                await asyncio.wait_for(self._ctrl_wake.wait(), self.cfg.poll_s)
            except asyncio.TimeoutError:
                pass

    # ------------------------------------------------------------------------------------- manifests

    def _read_manifest(self, v: int) -> tuple[bytes, mf.Manifest]:
        """Blocking (a worker thread): read and verify version ``v``'s manifest. Raises
        :class:`VersionNotFound`, :class:`UnusableVersion`, :class:`StoreError`."""
        k = mf.manifest_key(self.run_id, v)
        try:
            raw = self.store.get(k, limit=mf.MAX_MANIFEST_BYTES + 1)
        except ObjectNotFound:
            raise VersionNotFound(f"run {self.run_id!r} has no version {v}") from None
        try:
            return raw, mf.parse(raw, key=self.key, run_id=self.run_id, version=v, where=f"{self.store.url}/{k}")
        except StoreError:
            raise
        except SyncdError as exc:
            raise UnusableVersion(str(exc)) from exc

    async def _manifest(self, v: int) -> tuple[bytes, mf.Manifest]:
        """Version ``v``'s verified manifest (cached). Raises :class:`VersionNotFound`,
        :class:`UnusableVersion` (reported the first time), :class:`StoreError`."""
        got = self._manifests.get(v)
        if got is not None:
            return got
        if v in self._bad:
            raise UnusableVersion(self._bad[v])
        try:
            got = await asyncio.to_thread(self._read_manifest, v)
        except UnusableVersion as exc:
            self._unusable(v, exc)
            raise
        self._manifests[v] = got
        if len(self._manifests) > 256:
            del self._manifests[min(self._manifests)]
        return got

    def _unusable(self, v: int, exc: BaseException) -> None:
        self._bad[v] = str(exc)[:500]
        while len(self._bad) > 4096:
            del self._bad[min(self._bad)]
        log.error("node %d: version %d of run %s is unusable and skipped: %s", self.rank, v, self.run_id, exc)
        self.events("bad_version", v=v, why=str(exc)[:200])
        self._failure("manifest")

    async def _chain_start(self, v: int) -> int:
        m = (await self._manifest(v))[1]
        while m.kind == "delta":
            m = (await self._manifest(m.base_version))[1]
        return m.version

    # ------------------------------------------------------------------------------------- polling

    async def _poll_newest(self) -> None:
        """One poll (see the module docstring): raise ``_latest`` to the newest verified version found."""
        budget = [MAX_READS_PER_POLL]
        try:
            found, hint_bad = await self._from_hint(budget)
            if (hint_bad or time.monotonic() - self._listed_at >= LIST_EVERY_S) and budget[0] > 0:
                self._listed_at = time.monotonic()
                listed = await self._from_listing(budget)
                found = max((v for v in (found, listed) if v is not None), default=None)
            while found is not None and budget[0] > 0:  # the hint and the listing may lag the manifests
                nxt = await self._usable([found + 1], budget)
                if nxt is None:
                    break
                found = nxt
        except (StoreError, OSError) as exc:
            log.warning("node %d: polling run %s failed: %s", self.rank, self.run_id, exc)
            self._failure("store")
            return
        if found is not None and (self._latest is None or found > self._latest):
            self._latest = found
            self.events("latest", v=found)

    async def _from_hint(self, budget: list) -> tuple[int | None, bool]:
        """``(usable version from the hint or the probe after the newest known, whether to list)``: list
        when the hint changed but names nothing usable, or there is no hint and no version known yet."""
        try:
            got = await asyncio.to_thread(self.store.get_if_changed, mf.latest_hint_key(self.run_id), self._etag)
        except ObjectNotFound:
            got = None
            hint_bad = self._latest is None
        else:
            hint_bad = False
        candidates = [] if self._latest is None else [self._latest + 1]
        if got is not None:
            body, self._etag = got
            hinted = self._parse_hint(body)
            if hinted is not None:
                candidates.append(hinted)
        found = await self._usable(candidates, budget)
        if got is not None and (found is None or found < max(candidates, default=-1)):
            hint_bad = True  # it named something missing, unusable or old
        return found, hint_bad

    async def _from_listing(self, budget: list) -> int | None:
        """The newest usable version in a listing of the version directories: newest first while no version
        is known, else upwards from the newest known (real versions are dense there; forged far-future
        ones come last). Directories whose manifest was missing are skipped for :data:`LIST_EVERY_S`."""
        dirs = await asyncio.to_thread(self.store.list_dirs, mf.versions_prefix(self.run_id))
        now = time.monotonic()
        self._missing = {v: t for v, t in self._missing.items() if now - t < LIST_EVERY_S}
        listed = [v for v in map(mf.parse_version_dir, dirs) if v is not None and v not in self._missing]
        return await self._usable(listed, budget, upwards=self._latest is not None, note_missing=True)

    def _parse_hint(self, body: bytes) -> int | None:
        try:
            doc = wire.parse_json(body, "latest.json hint", max_bytes=HINT_MAX_BYTES)
            v = doc.get("version")
            mf.version_dir(v)
            return v
        except (ProtocolError, ValueError) as exc:
            if body != self._bad_hint:  # reported once per content, however often it is rewritten
                self._bad_hint = bytes(body)
                log.warning("node %d: run %s: the latest.json hint is unusable (%s); listing versions instead",
                            self.rank, self.run_id, str(exc)[:200])
                self.events("bad_hint", why=str(exc)[:200])
            return None

    async def _usable(self, candidates, budget: list, *, upwards: bool = False, note_missing: bool = False):
        """The highest of ``candidates`` above ``_latest`` whose manifest verifies, or None. Reads at most
        ``budget[0]`` manifests (decremented), newest first and stopping at the first usable one, or
        ``upwards`` through all of them."""
        floor = -1 if self._latest is None else self._latest
        best = None
        for v in sorted({v for v in candidates if v > floor}, reverse=not upwards):
            if v in self._bad:
                continue
            if v not in self._manifests:
                if budget[0] <= 0:
                    break
                budget[0] -= 1
            try:
                await self._manifest(v)
            except VersionNotFound:
                if note_missing:
                    self._missing[v] = time.monotonic()
                continue
            except UnusableVersion:
                continue
            best = v
            if not upwards:
                break
        return best

    def _slow_set(self, live: list[int]) -> set[int]:
        """Nodes to keep at the leaves. Children report, per parent, the rate they receive at while the
        parent has data ready, and parents that stalled while holding data; a parent far below the
        cluster's median rate, or reported stalled, is slow. Marks last 30 s (plans do not flap), and at
        most a third of the live nodes are slow at once (the most reported first): when everyone looks
        slow, the network is, not the nodes."""
        now = time.monotonic()
        per_parent: dict[int, list[int]] = {}
        for r in live:
            info = self.membership.info(r) if r != self.rank else self._heartbeat()
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
                if x < self.cfg.slow_fraction * overall:
                    old = self._slow.get(p, (0.0, 0))
                    self._slow[p] = (now, old[1] + 1)
        marked = sorted((p for p, (t, _) in self._slow.items() if now - t < 30 and p in live),
                        key=lambda p: (-self._slow[p][1], p))
        return set(marked[:len(live) // 3])

    async def _control_once(self) -> None:
        await self._poll_newest()
        if self._latest is None:
            return
        try:
            await self._plan_all(self._latest)
        except (StoreError, OSError) as exc:
            log.warning("node %d: planning stopped at a store error (next poll retries): %s", self.rank, exc)
            self._failure("store")

    async def _start_of(self, r: int, inc, latest: int) -> int | None:
        """The version a node without history starts at (the full version under ``latest``, fixed per
        incarnation), or None while ``latest``'s chain cannot be walked (reported)."""
        if (r, inc) not in self._starts:
            try:
                self._starts[(r, inc)] = await self._chain_start(latest)
            except (VersionNotFound, UnusableVersion) as exc:
                log.warning("node %d: no start version for rank %d yet: the chain of version %d is broken: %s",
                            self.rank, r, latest, exc)
                return None
        return self._starts[(r, inc)]

    async def _plan_all(self, latest: int) -> None:
        live = self.membership.live()
        nxt: dict[int, int] = {}
        delivered: dict[int, int] = {}
        for r in live:
            info = self._heartbeat() if r == self.rank else self.membership.info(r)
            inc = self.inc if r == self.rank else info.get("inc")
            d, s = info.get("delivered", -1), info.get("start", -1)
            delivered[r] = d
            if d >= 0 and d + 1 <= latest:
                try:
                    await self._manifest(d + 1)
                    nxt[r] = d + 1
                except (VersionNotFound, UnusableVersion):  # gone (retention) or unusable: the newest full one
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
            if r == self.rank and d < 0 and r in nxt and self._adopt_start(nxt[r]):
                self._pulse()
        if not nxt:
            return
        lo = min(nxt.values())
        slow = self._slow_set(live)
        for v in range(lo, latest + 1):
            try:
                raw, m = await self._manifest(v)
            except (VersionNotFound, UnusableVersion):
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
                part = (self._partial() if r == self.rank else self.membership.info(r).get("part")) or {}
                for s in m.shards:
                    n = part.get(s.sha256)
                    if isinstance(n, int) and not isinstance(n, bool) and 0 < n < s.size:
                        partial.setdefault(s.sha256, {})[r] = n
            for s in m.shards:
                for r in self._holders(s.sha256) if v in self.plans else ():
                    holders.setdefault(s.sha256, set()).add(r)
                if self.cache.has(s.sha256):
                    holders.setdefault(s.sha256, set()).add(self.rank)
            prev = self.plans.get(v)
            cand = plan_version(m, live=live, needers=needers, holders=holders, partial=partial,
                                prev=prev.plan if prev is not None else None, slow=slow, fanout=self.cfg.fanout,
                                chunk_bytes=self.cfg.chunk_bytes, store_streams=self.cfg.store_streams,
                                term=self.election.term, seq=self._seq + 1)
            if prev is None or prev.plan.key() != cand.key():
                self._seq += 1
                self._accept_plan(cand, m, raw)
                plan = cand
            else:
                plan = prev.plan
            payload = None
            for r in plan.members:
                if r == self.rank or r not in live:
                    continue
                inc = self.membership.info(r).get("inc")
                if self._sent.get((r, inc, v)) == plan.key():
                    continue
                if payload is None:
                    payload = wire.dump_json({"plan": plan.to_json(), "manifest": raw.decode("ascii")})
                if await self._send_control(r, T.PLAN, payload):
                    self._sent[(r, inc, v)] = plan.key()
        for k in [k for k in self._sent if k[2] < lo]:
            del self._sent[k]
