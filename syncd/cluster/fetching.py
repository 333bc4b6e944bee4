"""A cluster node's shard transfers (part of :class:`syncd.cluster.node.ClusterNode`): for each shard of a plan
it is in, a node reads it from the store if it is the shard's root (paced), else pulls it from its parent in
the shard's tree, moving up the tree when the parent dies or stalls, then to any live holder, and to the
store only as a last resort -- always resuming at the first chunk it lacks. Runs on the node's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from syncd import manifest as mf
from syncd.cluster import transfer
from syncd.cluster.errors import ClusterError, NotHeld, ProtocolError, Stalled
from syncd.cluster.planner import Plan
from syncd.errors import IntegrityError, ObjectNotFound, SyncdError

log = logging.getLogger("syncd.cluster.node")


@dataclass
class SourceRate:
    """Bytes per second received from one parent while it had data ready for us (EWMA)."""

    bytes: float = 0.0
    secs: float = 0.0

    def add(self, n: int, dt: float) -> None:
        self.bytes = self.bytes * 0.9 + n
        self.secs = self.secs * 0.9 + dt

    @property
    def rate(self) -> float:
        return self.bytes / self.secs if self.secs > 0 else 0.0


class ShardFetching:
    """Mixin of :class:`~syncd.cluster.node.ClusterNode`: where it gets each shard from (its shard workers,
    pulls and store reads). Uses the node's attributes (``cfg``, ``cache``, ``plans``, ``membership``, ...)."""

    def _holders(self, sha: str) -> list[int]:
        """Live peers that report holding ``sha`` complete (from heartbeats)."""
        out = []
        live = set(self.membership.live())
        for r in sorted(live - {self.rank}):
            info = self.membership.info(r)
            d = info.get("delivered", -1)
            for v, ps in self.plans.items():
                for i, s in enumerate(ps.manifest.shards):
                    if s.sha256 != sha:
                        continue
                    bits = info.get("hold", {}).get(str(v))
                    held = isinstance(d, int) and d >= v
                    if not held and isinstance(bits, str) and len(bits) <= 20000:
                        try:
                            held = bool(int(bits, 16) >> i & 1)
                        except ValueError:
                            held = False
                    if held and r not in out:
                        out.append(r)
        return out

    def _sources(self, sha: str, bad=()):
        """Where to get ``sha`` from now: ``(candidates, found)``, ``found`` = ``(ShardPlan, Plan, Manifest)``
        of the newest plan naming this node for it (None: no longer needed). Candidates, best first: the
        root takes it from a live peer that already holds it, else reads the store (empty list); any other
        node takes it from its parent, then the ancestors up to the root, then any live holder."""
        found = self._plan_for(sha)
        if found is None:
            return [], None
        sp, plan, _ = found
        live = set(self.membership.live())
        holders = [r for r in self._holders(sha) if r not in bad]
        if sp.root == self.rank:  # a root reads the store rather than wait on a slow holder
            cands = [r for r in holders if r not in plan.slow]
        else:
            cands = [r for r in sp.ancestors(self.rank, plan.fanout) if r in live and r not in bad]
            cands += [r for r in holders if r not in cands]
        slow = set(plan.slow)
        return sorted(cands, key=lambda r: r in slow), found  # stable: slow sources only as a last choice

    async def _shard_worker(self, sha: str, size: int) -> None:
        """Get shard ``sha`` into the cache while a plan names this node for it. What it does not expect is
        reported (:meth:`syncd.supervise.Supervisor.failed`) and the worker goes on after a backoff."""
        try:
            st = self.cache.state(sha, size)
            await self.cache.recover(st)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 -- e.g. a cached file of the wrong size: nothing to retry
            self.supervisor.failed(f"shard {sha[:12]}", exc)
            if self._workers.get(sha) is asyncio.current_task():
                del self._workers[sha]
            return
        bad: dict[int, float] = {}
        last_progress = time.monotonic()
        backoff = 0.2
        try:
            while self._running and not st.complete:
                try:
                    progressed = await self._shard_step(st, bad, last_progress)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 -- reported; the shard is still needed
                    self.supervisor.failed(f"shard {sha[:12]}", exc, restart_in=backoff)
                    await asyncio.sleep(backoff)
                    backoff = min(10.0, backoff * 2)
                    continue
                if progressed is None:
                    return  # no plan names this node for it any more
                if progressed:
                    last_progress, backoff = time.monotonic(), 0.2
        finally:
            if self._workers.get(sha) is asyncio.current_task():
                del self._workers[sha]

    async def _shard_step(self, st, bad: dict, last_progress: float) -> bool | None:
        """One attempt at the shard from its best source now; True if it made progress, None if no plan
        names this node for it any more."""
        now = time.monotonic()
        for r in [r for r, t in bad.items() if t <= now]:
            del bad[r]
        cands, found = self._sources(st.sha256, bad)
        if found is None:
            return None
        sp, plan, m = found
        have0 = st.have
        if cands:
            src = cands[0]
            try:
                await self._pull_from(src, st, plan, sp)
            except (Stalled, NotHeld, ProtocolError, IntegrityError, ClusterError, asyncio.TimeoutError,
                    asyncio.IncompleteReadError, OSError) as exc:
                slow_src = isinstance(exc, (Stalled, asyncio.TimeoutError)) and not getattr(exc, "peer_starved", False)
                if slow_src:
                    self._stalled[src] = time.monotonic()  # reported: the controller moves it to a leaf
                bad[src] = time.monotonic() + (5 * self.cfg.stall_s if slow_src
                                               else max(self.cfg.stall_s, 2 * self.cfg.dead_after_s))
                self.stats["switches"] += 1
                self.events("switch", sha=st.sha256[:16], src=src, have=st.have,
                            why=f"{type(exc).__name__}: {exc}"[:160])
                log.info("node %d: shard %s from rank %d failed at chunk %d (%s: %s)", self.rank, st.sha256[:12],
                         src, st.have, type(exc).__name__, exc)
        elif sp.root == self.rank:
            await self._root_fetch(st, plan, sp, m, why="root")
        elif time.monotonic() - last_progress > self.cfg.store_fallback_s:
            await self._root_fetch(st, plan, sp, m, why="fallback")
        else:
            await self._wait_pulse(self.cfg.heartbeat_s)  # no live source: wait for a new plan
        return st.have > have0 or st.complete

    async def _pull_from(self, src: int, st, plan: Plan, sp) -> None:
        """One pull of ``st`` from ``src``; cancelled (and the connection dropped) when a new plan makes
        another source the first choice, or ``src`` is no longer live."""
        async with self._pull_sem:
            st.busy, st.source = True, f"rank {src}"
            ch = await self._pool.acquire(src)
            ok = False
            rate = self._rates.setdefault(src, SourceRate())
            last = [time.monotonic()]
            ok_first = [False]

            def on_bytes(n: int, backlogged: bool) -> None:
                now = time.monotonic()
                if not ok_first[0]:
                    ok_first[0] = True
                    self.events("pulling", sha=st.sha256[:16], src=src, have=st.have)
                elif backlogged:  # only gaps where the parent had the chunk ready measure its speed
                    rate.add(n, now - last[0])
                last[0] = now
                self.stats["received_bytes"] += n
                self.stats["received_chunks"] += 1

            task = asyncio.create_task(transfer.pull(ch, st, self.cache, stall_s=self.cfg.stall_s,
                                                     dead_s=2 * self.cfg.dead_after_s, on_bytes=on_bytes))
            try:
                key = plan.key()
                while not task.done():
                    waiter = asyncio.ensure_future(asyncio.shield(self._replan_fut))
                    done, _ = await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
                    if task in done:
                        waiter.cancel()
                        break
                    found = self._plan_for(st.sha256)
                    if found is None or src not in self.membership.live():
                        task.cancel()
                        self.events("switch", sha=st.sha256[:16], src=src, have=st.have, why="source left")
                        break
                    if found[1].key() != key:
                        key = found[1].key()
                        cands, _ = self._sources(st.sha256)
                        if (cands[0] if cands else None) != src:
                            task.cancel()
                            self.events("switch", sha=st.sha256[:16], src=src, have=st.have, why="replanned")
                            break
                if task.cancelled() or not task.done():
                    try:
                        await task
                    except asyncio.CancelledError:
                        pass
                    return
                task.result()
                ok = True
            finally:
                if not task.done():
                    task.cancel()
                st.busy = False
                if ok:
                    self._pool.release(ch)
                else:
                    ch.close()

    async def _root_fetch(self, st, plan: Plan, sp, m: mf.Manifest, *, why: str) -> None:
        if why == "root":
            await self._pace(plan, sp)
        if st.complete:
            return
        key = mf.run_prefix(self.run_id) + m.shards[sp.index].key
        counted = [0]

        def on_bytes(n: int) -> None:
            counted[0] += n
            self.stats["store_bytes"] += n
            by = self.stats["store_bytes_by_version"]
            by[m.version] = by.get(m.version, 0) + n

        st.busy, st.source = True, "store"
        t0 = time.monotonic()
        try:
            await transfer.fetch_from_store(self.store, key, st, self.cache, chunk_bytes=plan.chunk_bytes,
                                            verify_first=self.cfg.verify_first, on_bytes=on_bytes)
        except ObjectNotFound:
            self.events("store_missing", v=m.version, key=key)
            await self._wait_pulse(self.cfg.heartbeat_s)
        except (IntegrityError, SyncdError, OSError) as exc:
            log.error("node %d: reading %s from the store failed: %s", self.rank, key, exc)
            self.events("store_error", v=m.version, key=key, why=str(exc)[:200])
            self._failure("integrity" if isinstance(exc, IntegrityError) else "store")
            await self._wait_pulse(self.cfg.heartbeat_s)
        finally:
            st.busy = False
            self.events("store_read", v=m.version, sha=st.sha256[:16], bytes=counted[0], why=why,
                        secs=round(time.monotonic() - t0, 4))

    async def _pace(self, plan: Plan, sp) -> None:
        """Wait until at most ``store_streams - 1`` shards earlier in the plan's fetch order are still
        being read from the store (seen here as: their chunk list has not reached this node), or until
        ``pace_timeout_s`` passes without progress."""
        need = sp.fetch_rank - plan.store_streams + 1
        if plan.store_streams == 0 or need <= 0:
            return
        earlier = [s.sha256 for s in plan.shards if s.fetch_rank < sp.fetch_rank]
        deadline = time.monotonic() + self.cfg.pace_timeout_s
        while self._running:
            ready = 0
            for sha in earlier:
                st = self.cache.states.get(sha)
                if (st is not None and (st.complete or (st.chunk_bytes and st.have == st.n))) or self.cache.has(sha):
                    ready += 1
            if ready >= need:
                return
            now = time.monotonic()
            if now >= deadline:
                log.info("node %d: pacing timed out for shard %d (%d/%d earlier shards available)", self.rank,
                         sp.index, ready, need)
                return
            fut = self._pulse_fut
            await self._wait_pulse(deadline - now)
            if fut.done():
                deadline = max(deadline, time.monotonic() + self.cfg.pace_timeout_s / 4)
