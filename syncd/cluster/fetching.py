"""The relay role of a cluster node (:class:`Relay`, held by :class:`~syncd.cluster.node.ClusterNode`): getting
each shard of the plans a node is in into its cache, and serving it on to the node's children.

For each such shard a node reads it from the store if it is the shard's root (paced), else pulls it from its
parent in the shard's tree, moving up the tree when the parent dies or stalls, then to any live holder, and to
the store only as a last resort -- always resuming at the first chunk it lacks; and it answers its children's
pulls from what it holds, chunk by chunk as it arrives (:mod:`syncd.cluster.transfer`). Runs on the node's event
loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from syncd import manifest as mf
from syncd.cluster import transfer, wire
from syncd.cluster.errors import ClusterError, NotHeld, ProtocolError, Stalled
from syncd.cluster.planner import Plan
from syncd.cluster.wire import T
from syncd.errors import IntegrityError, ObjectNotFound, SyncdError

log = logging.getLogger("syncd.cluster.node")

__all__ = ["Relay", "SourceRate"]


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


class Relay:
    """The relay role of ``node`` (see the module docstring); made by :meth:`ClusterNode.start` (on its loop).

    ``workers``: the shard workers by SHA-256; ``rates``: what this node receives at from each parent;
    ``stalled``: parents that stalled holding data (both reported in heartbeats: the controller moves slow
    parents to the leaves)."""

    def __init__(self, node):
        self.node = node
        self.workers: dict[str, asyncio.Task] = {}
        self.rates: dict[int, SourceRate] = {}
        self.stalled: dict[int, float] = {}
        self._pull_sem = asyncio.Semaphore(node.cfg.pull_window)
        self._throttle = transfer.Throttle(node.cfg.throttle_bps)
        self.pool = transfer.PeerPool(lambda r: node.dial(r, "data"))

    def close(self) -> list[asyncio.Task]:
        """Close the data connections; the tasks still to cancel and await."""
        self.pool.close()
        return list(self.workers.values())

    def ensure(self, sha: str, size: int) -> None:
        """Have a worker get shard ``sha`` (``size`` bytes) unless one is at it already."""
        w = self.workers.get(sha)
        if w is None or w.done():
            self.workers[sha] = asyncio.create_task(self._worker(sha, size))

    def partial(self) -> dict[str, int]:
        """``{sha256: verified bytes}`` of the shards this node holds in part (at most 256)."""
        out = {}
        for sha, st in self.node.cache.states.items():
            if not st.complete and st.have and st.chunk_bytes and len(out) < 256:
                out[sha] = min(st.have * st.chunk_bytes, st.size)
        return out

    # ------------------------------------------------------------------------------------- serving children

    async def serve(self, chan: wire.Channel) -> None:
        """Serve an accepted data connection: one pull after another. Raises :class:`ProtocolError`."""
        node = self.node
        while True:
            f = await chan.recv()
            if f.type != T.PULL:
                raise ProtocolError(f"unexpected {f.type.name} on a data connection")
            await transfer.serve_pull(chan, f.json(), node.cache, lookup=self._lookup,
                                      keepalive_s=node.cfg.heartbeat_s, chunk_bytes=node.cfg.chunk_bytes,
                                      throttle=self._throttle, stats=node.stats)

    async def _lookup(self, sha: str, size: int):
        """The shard state to serve, waiting briefly for a plan that names it (it may arrive after a
        child's request). None if this node neither holds nor expects it."""
        node = self.node
        deadline = time.monotonic() + 2 * node.cfg.heartbeat_s
        while True:
            st = node.cache.get(sha)
            if st is not None and (st.complete or st.busy or st.chunk_bytes is not None):
                return st
            if sha in self.workers and not self.workers[sha].done():
                return node.cache.state(sha, size)
            if time.monotonic() >= deadline:
                return None
            await node.wait_pulse(deadline - time.monotonic())

    # ------------------------------------------------------------------------------------- getting shards

    def holders(self, sha: str) -> list[int]:
        """Live peers that report holding ``sha`` complete (from heartbeats)."""
        out = []
        live = set(self.node.heartbeats.membership.live())
        for r in sorted(live - {self.node.rank}):
            info = self.node.heartbeats.membership.info(r)
            d = info.get("delivered", -1)
            for v, ps in self.node.plans.items():
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

    def sources(self, sha: str, bad=()):
        """Where to get ``sha`` from now: ``(candidates, found)``, ``found`` = ``(ShardPlan, Plan, Manifest)``
        of the newest plan naming this node for it (None: no longer needed). Candidates, best first: the
        root takes it from a live peer that already holds it, else reads the store (empty list); any other
        node takes it from its parent, then the ancestors up to the root, then any live holder."""
        found = self.node.plan_for(sha)
        if found is None:
            return [], None
        sp, plan, _ = found
        live = set(self.node.heartbeats.membership.live())
        holders = [r for r in self.holders(sha) if r not in bad]
        if sp.root == self.node.rank:  # a root reads the store rather than wait on a slow holder
            cands = [r for r in holders if r not in plan.slow]
        else:
            cands = [r for r in sp.ancestors(self.node.rank, plan.fanout) if r in live and r not in bad]
            cands += [r for r in holders if r not in cands]
        slow = set(plan.slow)
        return sorted(cands, key=lambda r: r in slow), found  # stable: slow sources only as a last choice

    async def _worker(self, sha: str, size: int) -> None:
        """Get shard ``sha`` into the cache while a plan names this node for it. What it does not expect is
        reported (:meth:`syncd.supervise.Supervisor.failed`) and the worker goes on after a backoff."""
        try:
            st = self.node.cache.state(sha, size)
            await self.node.cache.recover(st)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 -- e.g. a cached file of the wrong size: nothing to retry
            self.node.supervisor.failed(f"shard {sha[:12]}", exc)
            if self.workers.get(sha) is asyncio.current_task():
                del self.workers[sha]
            return
        bad: dict[int, float] = {}
        last_progress = time.monotonic()
        backoff = 0.2
        try:
            while self.node.running and not st.complete:
                try:
                    progressed = await self._step(st, bad, last_progress)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 -- reported; the shard is still needed
                    self.node.supervisor.failed(f"shard {sha[:12]}", exc, restart_in=backoff)
                    await asyncio.sleep(backoff)
                    backoff = min(10.0, backoff * 2)
                    continue
                if progressed is None:
                    return  # no plan names this node for it any more
                if progressed:
                    last_progress, backoff = time.monotonic(), 0.2
        finally:
            if self.workers.get(sha) is asyncio.current_task():
                del self.workers[sha]

    async def _step(self, st, bad: dict, last_progress: float) -> bool | None:
        """One attempt at the shard from its best source now; True if it made progress, None if no plan
        names this node for it any more."""
        now = time.monotonic()
        for r in [r for r, t in bad.items() if t <= now]:
            del bad[r]
        cands, found = self.sources(st.sha256, bad)
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
                    self.stalled[src] = time.monotonic()  # reported: the controller moves it to a leaf
                bad[src] = time.monotonic() + (5 * self.node.cfg.stall_s if slow_src
                                               else max(self.node.cfg.stall_s, 2 * self.node.cfg.dead_after_s))
                self.node.stats["switches"] += 1
                self.node.events("switch", sha=st.sha256[:16], src=src, have=st.have,
                            why=f"{type(exc).__name__}: {exc}"[:160])
                log.info("node %d: shard %s from rank %d failed at chunk %d (%s: %s)", self.node.rank, st.sha256[:12],
                         src, st.have, type(exc).__name__, exc)
        elif sp.root == self.node.rank:
            await self._root_fetch(st, plan, sp, m, why="root")
        elif time.monotonic() - last_progress > self.node.cfg.store_fallback_s:
            await self._root_fetch(st, plan, sp, m, why="fallback")
        else:
            await self.node.wait_pulse(self.node.cfg.heartbeat_s)  # no live source: wait for a new plan
        return st.have > have0 or st.complete

    async def _pull_from(self, src: int, st, plan: Plan, sp) -> None:
        """One pull of ``st`` from ``src``; cancelled (and the connection dropped) when a new plan makes
        another source the first choice, or ``src`` is no longer live."""
        async with self._pull_sem:
            st.busy, st.source = True, f"rank {src}"
            ch = await self.pool.acquire(src)
            ok = False
            rate = self.rates.setdefault(src, SourceRate())
            last = [time.monotonic()]
            ok_first = [False]

            def on_bytes(n: int, backlogged: bool) -> None:
                now = time.monotonic()
                if not ok_first[0]:
                    ok_first[0] = True
                    self.node.events("pulling", sha=st.sha256[:16], src=src, have=st.have)
                elif backlogged:  # only gaps where the parent had the chunk ready measure its speed
                    rate.add(n, now - last[0])
                last[0] = now
                self.node.stats["received_bytes"] += n
                self.node.stats["received_chunks"] += 1

            task = asyncio.create_task(transfer.pull(ch, st, self.node.cache, stall_s=self.node.cfg.stall_s,
                                                     dead_s=2 * self.node.cfg.dead_after_s, on_bytes=on_bytes))
            try:
                key = plan.key()
                while not task.done():
                    waiter = asyncio.ensure_future(asyncio.shield(self.node.replan_future))
                    done, _ = await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
                    if task in done:
                        waiter.cancel()
                        break
                    found = self.node.plan_for(st.sha256)
                    if found is None or src not in self.node.heartbeats.membership.live():
                        task.cancel()
                        self.node.events("switch", sha=st.sha256[:16], src=src, have=st.have, why="source left")
                        break
                    if found[1].key() != key:
                        key = found[1].key()
                        cands, _ = self.sources(st.sha256)
                        if (cands[0] if cands else None) != src:
                            task.cancel()
                            self.node.events("switch", sha=st.sha256[:16], src=src, have=st.have, why="replanned")
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
                    self.pool.release(ch)
                else:
                    ch.close()

    async def _root_fetch(self, st, plan: Plan, sp, m: mf.Manifest, *, why: str) -> None:
        if why == "root":
            await self._pace(plan, sp)
        if st.complete:
            return
        key = mf.run_prefix(self.node.run_id) + m.shards[sp.index].key
        counted = [0]

        def on_bytes(n: int) -> None:
            counted[0] += n
            self.node.stats["store_bytes"] += n
            by = self.node.stats["store_bytes_by_version"]
            by[m.version] = by.get(m.version, 0) + n

        st.busy, st.source = True, "store"
        t0 = time.monotonic()
        try:
            await transfer.fetch_from_store(self.node.store, key, st, self.node.cache, chunk_bytes=plan.chunk_bytes,
                                            verify_first=self.node.cfg.verify_first, on_bytes=on_bytes)
        except ObjectNotFound:
            self.node.events("store_missing", v=m.version, key=key)
            await self.node.wait_pulse(self.node.cfg.heartbeat_s)
        except (IntegrityError, SyncdError, OSError) as exc:
            log.error("node %d: reading %s from the store failed: %s", self.node.rank, key, exc)
            self.node.events("store_error", v=m.version, key=key, why=str(exc)[:200])
            self.node.failure("integrity" if isinstance(exc, IntegrityError) else "store")
            await self.node.wait_pulse(self.node.cfg.heartbeat_s)
        finally:
            st.busy = False
            self.node.events("store_read", v=m.version, sha=st.sha256[:16], bytes=counted[0], why=why,
                        secs=round(time.monotonic() - t0, 4))

    async def _pace(self, plan: Plan, sp) -> None:
        """Wait until at most ``store_streams - 1`` shards earlier in the plan's fetch order are still
        being read from the store (seen here as: their chunk list has not reached this node), or until
        ``pace_timeout_s`` passes without progress."""
        need = sp.fetch_rank - plan.store_streams + 1
        if plan.store_streams == 0 or need <= 0:
            return
        earlier = [s.sha256 for s in plan.shards if s.fetch_rank < sp.fetch_rank]
        deadline = time.monotonic() + self.node.cfg.pace_timeout_s
        while self.node.running:
            ready = 0
            for sha in earlier:
                st = self.node.cache.states.get(sha)
                if ((st is not None and (st.complete or (st.chunk_bytes and st.have == st.n)))
                        or self.node.cache.has(sha)):
                    ready += 1
            if ready >= need:
                return
            now = time.monotonic()
            if now >= deadline:
                log.info("node %d: pacing timed out for shard %d (%d/%d earlier shards available)", self.node.rank,
                         sp.index, ready, need)
                return
            fut = self.node.pulse_future
            await self.node.wait_pulse(deadline - now)
            if fut.done():
                deadline = max(deadline, time.monotonic() + self.node.cfg.pace_timeout_s / 4)
