"""The controller's side of a cluster node (part of :class:`syncd.cluster.node.ClusterNode`): while a node is the
controller it polls the store for new versions, plans every version some live node still needs (roots,
trees, slow nodes at the leaves), and sends each plan with its signed manifest to the nodes in it, again
whenever membership changes. On takeover it continues from shared state, not from its predecessor. Runs on
the node's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time

from syncd import manifest as mf
from syncd.cluster import wire
from syncd.cluster.planner import plan_version
from syncd.cluster.wire import T
from syncd.errors import ObjectNotFound, SyncdError, VersionNotFound

log = logging.getLogger("syncd.cluster.node")


class ControllerRole:
    """Mixin of :class:`~syncd.cluster.node.ClusterNode`: what it does while it is the controller."""

    def _rebuild_controller_state(self) -> None:
        """On takeover: continue from shared state -- the plans this node received (every node gets
        them), each node's delivered version and holdings (heartbeats), the manifests (store)."""
        self._sent.clear()
        self._etag = None
        for v, ps in self.plans.items():
            self._manifests.setdefault(v, (ps.raw, ps.manifest))
        self._seq = max([ps.plan.seq for ps in self.plans.values()] + [self._seq])

    async def _controller_loop(self) -> None:
        while self._running:
            if self.is_controller:
                try:
                    await self._control_once()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - the controller keeps going
                    log.exception("node %d: controller step failed", self.rank)
                    self.events("controller_error", why=f"{type(exc).__name__}: {exc}"[:200])
            self._ctrl_wake.clear()
            try:
                await asyncio.wait_for(self._ctrl_wake.wait(), self.cfg.poll_s)
            except asyncio.TimeoutError:
                pass

    async def _manifest(self, v: int) -> tuple[bytes, mf.Manifest]:
        got = self._manifests.get(v)
        if got is None:
            k = mf.manifest_key(self.run_id, v)
            try:
                raw = await asyncio.to_thread(self.store.get, k, limit=mf.MAX_MANIFEST_BYTES + 1)
            except ObjectNotFound:
                raise VersionNotFound(f"run {self.run_id!r} has no version {v}") from None
            m = mf.parse(raw, key=self.key, run_id=self.run_id, version=v, where=f"{self.store.url}/{k}")
            got = self._manifests[v] = (raw, m)
            if len(self._manifests) > 256:
                del self._manifests[min(self._manifests)]
        return got

    async def _chain_start(self, v: int) -> int:
        m = (await self._manifest(v))[1]
        while m.kind == "delta":
            m = (await self._manifest(m.base_version))[1]
        return m.version

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
        got = await asyncio.to_thread(poll_latest_safe, self.store, self.run_id, self._etag, self.key)
        if got is not None:
            latest, self._etag = got
            if latest is not None and latest != self._latest:
                self._latest = latest
                self.events("latest", v=latest)
        latest = self._latest
        if latest is None:
            return
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
                except VersionNotFound:  # gone (retention): continue at the newest full version
                    nxt[r] = self._starts.setdefault((r, inc), await self._chain_start(latest))
            elif d >= 0:
                nxt[r] = d + 1
            elif s >= 0:
                nxt[r] = s
            else:
                nxt[r] = self._starts.setdefault((r, inc), await self._chain_start(latest))
            if r == self.rank and d < 0 and self._adopt_start(nxt[r]):
                self._pulse()
        lo = min(nxt.values())
        slow = self._slow_set(live)
        for v in range(lo, latest + 1):
            try:
                raw, m = await self._manifest(v)
            except VersionNotFound:
                continue
            needers = {r for r in live if nxt[r] <= v}
            if not needers:
                continue
            holders: dict[str, set[int]] = {}
            for r in live:
                if delivered[r] >= v:
                    for s in m.shards:
                        holders.setdefault(s.sha256, set()).add(r)
            for s in m.shards:
                for r in self._holders(s.sha256) if v in self.plans else ():
                    holders.setdefault(s.sha256, set()).add(r)
                if self.cache.has(s.sha256):
                    holders.setdefault(s.sha256, set()).add(self.rank)
            prev = self.plans.get(v)
            cand = plan_version(m, live=live, needers=needers, holders=holders,
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


def poll_latest_safe(store, run_id, etag, key):
    """:func:`syncd.versions.poll_latest`, with store and manifest errors logged instead of raised."""
    from syncd.versions import poll_latest

    try:
        return poll_latest(store, run_id, etag, signing_key=key or False)
    except (SyncdError, OSError) as exc:
        log.error("polling run %s for new versions failed: %s", run_id, exc)
        return None
