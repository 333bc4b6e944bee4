"""One node of a syncd cluster: :class:`ClusterNode`, which runs inside a daemon's asyncio loop (settings:
:mod:`syncd.cluster.config`; the standalone process ``python -m syncd.cluster.node``, a node without engines
for tests and benchmarks: :mod:`syncd.cluster.cli`).

What a node does (``docs/cluster.md``), through its roles -- objects with their own state, each in its module:

* :class:`~syncd.cluster.heartbeats.Heartbeats` (membership): heartbeats to every member, liveness, the
  election (:mod:`syncd.cluster.election`, or through etcd :mod:`syncd.cluster.etcd_election`), the control
  connections that carry heartbeats and plans;
* :class:`~syncd.cluster.controller.Controller`: while elected, polls the store for the newest verified
  version, plans every version some live node still needs (:mod:`syncd.cluster.planner`) and sends the plans;
* :class:`~syncd.cluster.fetching.Relay`: gets each shard of the plans it is in into the cache (from the
  store as a root, else down its tree from the parent, up the tree when one dies or stalls, the store last)
  and serves its children's pulls (:mod:`syncd.cluster.transfer`).

The node itself listens for authenticated connections (:mod:`syncd.cluster.auth`) and hands them to the roles,
keeps what they share (the plans, the shard cache, the delivered version, the counters, the event log) and
calls ``on_version_ready(manifest)`` once every shard of a version is in its cache, in version order, never
skipping or repeating one.

Supervision: the node's long-lived tasks (heartbeats, the controller, delivery, discovery) run under a
:class:`~syncd.supervise.Supervisor`, and shard workers and connection handlers report what they did not
expect the same way: every exception is caught, logged with the node and task, counted (``failures``:
the ``failures(kind)`` callable the node was given, e.g. the daemon's ``syncd_failures_total{kind}``, and
:meth:`ClusterNode.summary`), written to the event log (``task_error``) and, for a long-lived task, followed
by a restart after a backoff. Everything the node parses from a peer, the store or its own state file is
bounded (:func:`syncd.cluster.wire.parse_json`).

Thread-safety: a :class:`ClusterNode` belongs to the asyncio loop that called :meth:`ClusterNode.start`;
call its methods from that loop only. Store reads and file hashing run in worker threads.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from dataclasses import dataclass

from syncd import manifest as mf
from syncd.cache import ShardCache
from syncd.cluster import auth, wire
from syncd.cluster.auth import ClusterSecret
from syncd.cluster.config import NO_HISTORY, ClusterConfig
from syncd.cluster.controller import Controller
from syncd.cluster.errors import AuthError, ClusterError, ProtocolError
from syncd.cluster.fetching import Relay
from syncd.cluster.heartbeats import Heartbeats
from syncd.cluster.membership import Member
from syncd.cluster.partials import PartialShards
from syncd.cluster.planner import Plan
from syncd.cluster.state import DeliveredRecord, EventLog
from syncd.errors import SyncdError
from syncd.signing import resolve_key
from syncd.store import Store
from syncd.supervise import Supervisor

log = logging.getLogger(__name__)


@dataclass
class _PlanState:
    plan: Plan
    manifest: mf.Manifest
    raw: bytes
    sender: int  # the controller it came from

    def order(self) -> tuple[int, int, int]:
        """Which plan of a version wins: the highest term; in one term (two nodes that claimed at once) the lower
        rank, the one the election keeps; then the highest seq."""
        return self.plan.term, -self.sender, self.plan.seq


class ClusterNode:
    """One node of a cluster (see the module docstring).

    ``store``: URL or :class:`~syncd.store.Store` the versions are read from. ``run_id``: the run.
    ``secret``: the :class:`~syncd.cluster.auth.ClusterSecret`. ``cache_root``: the local cache (shards go
    to ``<cache_root>/shards/<sha256>``). ``config``: :class:`ClusterConfig`. ``signing_key``: manifest
    key (None: from the environment; every node verifies every manifest itself).
    ``on_version_ready``: ``async (manifest) -> None``, called in version order once all of a version's
    shards are cached; if it raises, the same version is offered again after ``heartbeat_s``.
    ``delivered``: the version this node's engines already have (None: read
    ``<cache_root>/cluster/state.json``; with no record, or with :data:`NO_HISTORY`, the node starts at the
    newest full version the controller names). ``events``: path of a JSON-lines event log (tests,
    benchmarks). ``failures``: ``(kind) -> None``, called for every failure counted (see the module
    docstring). :meth:`summary` reports the node's state and counters (for metrics and status).
    """

    def __init__(self, store, run_id: str, *, secret: ClusterSecret, cache_root, config: ClusterConfig,
                 signing_key=None, on_version_ready=None, delivered: int | None = None, events=None,
                 failures=None):
        self.store = Store.open(store)
        self.run_id = mf.check_run_id(run_id)
        self.secret, self.cfg = secret, config
        self.key = resolve_key(signing_key)
        if self.key is None:
            log.warning("cluster node %d: no signing key; manifests are NOT authenticated", config.rank)
        self.rank = config.rank
        self.cache = PartialShards(ShardCache(cache_root), secret, fsync=config.fsync)
        self.record = DeliveredRecord(os.path.join(self.cache.root, "cluster", "state.json"), self.run_id)
        self.on_version_ready = on_version_ready
        if delivered is not None and delivered < 0 and delivered != NO_HISTORY:
            raise ValueError(f"delivered must be a version, None or NO_HISTORY, not {delivered}")
        self.delivered = (None if delivered == NO_HISTORY else delivered if delivered is not None
                          else self.record.load())
        self.start_version: int | None = None
        self.inc = secrets.token_hex(8)
        self.events = EventLog(events)
        self.stats = {"refused_connections": 0, "bad_frames": 0, "store_bytes": 0, "store_bytes_by_version": {},
                      "served_bytes": 0, "served_chunks": 0, "received_bytes": 0, "received_chunks": 0,
                      "switches": 0, "delivered": [], "failures": {}, "stale_refused": 0}
        self._failures_hook = failures
        self.supervisor = Supervisor(f"cluster node {self.rank}", on_failure=self.failure, on_error=self._task_error,
                                     logger=log)
        self.plans: dict[int, _PlanState] = {}
        self.heartbeats: Heartbeats | None = None  # the roles, made by start() on the node's loop
        self.relay: Relay | None = None
        self.controller: Controller | None = None
        self.running = False
        self.pulse_future: asyncio.Future | None = None  # done at any progress (a chunk, a shard, a plan, ...)
        self.replan_future: asyncio.Future | None = None  # done when pulls must re-check their source
        self._server = None

    # ------------------------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Bind the listening socket and start every background task; returns once listening. Raises
        ``OSError`` if the address cannot be bound."""
        cfg = self.cfg
        loop = asyncio.get_running_loop()
        self.pulse_future = loop.create_future()
        self.replan_future = loop.create_future()
        members = dict(cfg.peers or {})
        if (cfg.cluster_id is not None or cfg.etcd) and cfg.advertise is not None:
            members[self.rank] = Member(self.rank, cfg.advertise[0], int(cfg.advertise[1]))
        if self.rank not in members:
            raise ValueError(f"rank {self.rank} has no address (not in the peer list, no advertise)")
        self.heartbeats = Heartbeats(self, members)
        self.relay = Relay(self)
        self.controller = Controller(self)
        me = members[self.rank]
        host, port = cfg.listen or (me.host, me.port)
        self._server = await asyncio.start_server(self._accept, host, port, limit=1 << 20, reuse_address=True)
        self.cache.on_complete = lambda st: self.pulse()
        self.cache.on_corrupt = self._on_corrupt
        self.running = True
        self.supervisor.spawn("heartbeat", self.heartbeats.loop)
        self.supervisor.spawn("controller", self.controller.loop)
        self.supervisor.spawn("deliver", self._deliver_loop)
        if cfg.cluster_id is not None:
            self.supervisor.spawn("discover", self.heartbeats.discover_loop)
        for name, loop_fn in self.heartbeats.election.loops().items():
            self.supervisor.spawn(name, loop_fn)
        self.events("start", rank=self.rank, inc=self.inc, delivered=self.delivered, pid=os.getpid())
        log.info("cluster node %d listening on %s:%d (incarnation %s)", self.rank, host, port, self.inc)

    async def stop(self) -> None:
        """Stop every task and close every connection (idempotent)."""
        if not self.running:
            return
        self.running = False
        if self._server is not None:
            self._server.close()
        await self.supervisor.stop()
        await self.heartbeats.election.close()
        tasks = [*self.heartbeats.close(), *self.relay.close()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.events("stop", rank=self.rank)
        self.events.close()

    @property
    def is_controller(self) -> bool:
        return self.heartbeats is not None and self.heartbeats.election.is_controller

    def manifest_bytes(self, version: int) -> bytes | None:
        """The exact (signed, verified) manifest bytes of ``version`` as planned here, or None if this node
        holds no plan of it (e.g. forgotten long after delivery)."""
        ps = self.plans.get(version)
        return ps.raw if ps is not None else None

    def summary(self) -> dict:
        """This node's state and counters as plain JSON values: ``rank``, ``listen`` (``host:port``),
        ``members`` and ``live`` (ranks), ``controller`` (rank or None), ``is_controller``, ``term`` (the
        highest controller term seen), ``delivered`` (version or None), ``peer_restarts``, and the counters
        ``refused_connections``, ``bad_frames``, ``received_bytes``/``received_chunks`` (from peers),
        ``store_bytes`` (shard bytes read from the store), ``served_bytes``/``served_chunks`` (to peers),
        ``relays_lost`` (pulls whose source died, stalled or failed, moved to another source),
        ``failures`` (``{kind: count}``), ``tasks`` (:meth:`syncd.supervise.Supervisor.health`) and
        ``skipped_versions`` (``{version: why}`` of the unusable versions the controller skipped, newest 16),
        ``election`` (``"etcd"`` or ``"builtin"``) and ``stale_refused`` (plans and controller heartbeats refused
        for a term older than the newest seen).
        Call from the node's loop (or accept a value a moment old from another thread)."""
        st = self.stats
        roles = self.heartbeats is not None
        mem = self.heartbeats.membership if roles else None
        el = self.heartbeats.election if roles else None
        me = mem.members.get(self.rank) if mem is not None else None
        return {"rank": self.rank, "listen": f"{me.host}:{me.port}" if me is not None else None,
                "members": sorted(mem.members) if mem is not None else [],
                "live": mem.live() if mem is not None else [],
                "controller": el.controller if el is not None else None, "is_controller": self.is_controller,
                "term": el.max_term if el is not None else 0, "delivered": self.delivered,
                "peer_restarts": sum(mem.restarts.values()) if mem is not None else 0,
                "refused_connections": st["refused_connections"], "bad_frames": st["bad_frames"],
                "received_bytes": st["received_bytes"], "received_chunks": st["received_chunks"],
                "store_bytes": st["store_bytes"], "served_bytes": st["served_bytes"],
                "served_chunks": st["served_chunks"], "relays_lost": st["switches"],
                "failures": dict(st["failures"]), "tasks": self.supervisor.health(),
                "skipped_versions": self.controller.skipped() if roles else {},
                "election": "etcd" if self.cfg.etcd else "builtin", "stale_refused": st["stale_refused"]}

    def failure(self, kind: str) -> None:
        """Count one failure of ``kind`` (here and in the ``failures`` hook)."""
        self.stats["failures"][kind] = self.stats["failures"].get(kind, 0) + 1
        if self._failures_hook is not None:
            self._failures_hook(kind)

    def _task_error(self, name: str, exc: BaseException) -> None:
        self.events("task_error", task=name, why=f"{type(exc).__name__}: {exc}"[:300])

    def pulse(self) -> None:
        """Wake everything that waits for progress (a chunk, a shard, a plan, a heartbeat)."""
        if self.pulse_future is not None and not self.pulse_future.done():
            self.pulse_future.set_result(None)
        self.pulse_future = asyncio.get_running_loop().create_future()

    def replanned(self) -> None:
        """Wake the pulls that must check whether their source is still the right one."""
        if not self.replan_future.done():
            self.replan_future.set_result(None)
        self.replan_future = asyncio.get_running_loop().create_future()
        self.pulse()

    async def wait_pulse(self, timeout: float) -> None:
        """Wait for the next :meth:`pulse`, at most ``timeout`` seconds."""
        try:
            await asyncio.wait_for(asyncio.shield(self.pulse_future), timeout)
        except asyncio.TimeoutError:
            pass

    # ------------------------------------------------------------------------------------- delivered version

    def _save_delivered(self) -> None:
        """Record the delivered version (best effort: a failure is logged and counted; the next delivery
        writes the file again, and a restart without it starts at the newest full version)."""
        try:
            self.record.save(self.delivered)
        except OSError as exc:
            log.error("node %d: cannot record delivered version %s in %s: %s", self.rank, self.delivered,
                      self.record.path, exc)
            self.events("state_error", v=self.delivered, why=str(exc)[:200])
            self.failure("cache")

    # ------------------------------------------------------------------------------------- connections

    async def dial(self, rank: int, role: str) -> wire.Channel:
        """An authenticated connection to member ``rank`` (``role``: ``"control"`` or ``"data"``)."""
        m = self.heartbeats.membership.members.get(rank)
        if m is None:
            raise ClusterError(f"rank {rank} is not a known member")
        try:
            ch = await auth.connect(m.host, m.port, self.secret, rank=self.rank, role=role,
                                    timeout=self.cfg.connect_timeout_s)
        except (AuthError, ProtocolError):
            self.stats["refused_connections"] += 1
            raise
        if ch.peer != rank:
            ch.close()
            raise AuthError(f"{m.host}:{m.port} answered as rank {ch.peer}, expected {rank}")
        return ch

    async def _accept(self, reader, writer) -> None:
        peer = writer.get_extra_info("peername")
        try:
            chan = await auth.accept(reader, writer, self.secret, rank=self.rank,
                                     timeout=self.cfg.connect_timeout_s)
        except (AuthError, ProtocolError, asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError) as exc:
            self.stats["refused_connections"] += 1
            self.events("refused", peer=str(peer), why=f"{type(exc).__name__}: {exc}"[:200])
            log.warning("node %d: refused connection from %s: %s: %s", self.rank, peer, type(exc).__name__, exc)
            writer.close()
            return
        try:
            if chan.role == "control":
                await self.heartbeats.read(chan)
            else:
                await self.relay.serve(chan)
        except (AuthError, ProtocolError) as exc:
            self.stats["bad_frames"] += 1
            self.events("bad_frame", peer=chan.peer, why=str(exc)[:200])
            log.warning("node %d: closing connection from rank %d: %s", self.rank, chan.peer, exc)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError, OSError):
            pass
        except Exception as exc:  # noqa: BLE001 -- one connection's handler: reported, the node goes on
            self.supervisor.failed(f"{chan.role} connection from rank {chan.peer}", exc, kind="connection")
        finally:
            chan.close()

    # ------------------------------------------------------------------------------------- holdings

    def adopt_start(self, v: int) -> bool:
        """Start at full version ``v`` (the controller names it) when this node has no usable history."""
        if self.start_version == v:
            return False
        if self.delivered is None or v > self.delivered + 1:
            if self.delivered is not None:
                log.warning("node %d: versions %d..%d are gone from the store; continuing at full version %d",
                            self.rank, self.delivered + 1, v - 1, v)
            self.start_version = v
            self.events("start_version", v=v)
            return True
        return False

    # ------------------------------------------------------------------------------------- plans

    def refuse_stale(self, what: str, sender: int, term: int) -> None:
        """A ``what`` (plan, heartbeat) from ``sender`` carries ``term``, older than the newest seen: refused
        (counted in ``stale_refused``, a ``stale_refused`` event)."""
        newest = self.heartbeats.election.max_term
        self.stats["stale_refused"] += 1
        self.events("stale_refused", what=what, peer=sender, term=term, newest=newest)
        log.info("node %d: refused a %s of rank %d: its term %d is older than term %d", self.rank, what, sender,
                 term, newest)

    async def on_plan(self, sender: int, msg: dict) -> None:
        """A PLAN from ``sender``: refused if its term is stale (fencing), else its manifest verified here and
        the plan accepted."""
        raw = msg.get("manifest")
        if not isinstance(raw, str) or not isinstance(msg.get("plan"), dict):
            raise ProtocolError("PLAN without manifest and plan")
        term = msg["plan"].get("term")
        if not isinstance(term, int) or isinstance(term, bool):
            raise ProtocolError("PLAN without an integer term")
        if self.heartbeats.election.is_stale(term):
            self.refuse_stale("plan", sender, term)
            return
        raw_b = raw.encode("ascii", errors="strict")
        v = msg["plan"].get("version")
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= mf.MAX_VERSION:
            raise ProtocolError("PLAN with a bad version")
        try:
            m = mf.parse(raw_b, key=self.key, run_id=self.run_id, version=v, where=f"plan from rank {sender}")
        except SyncdError as exc:  # a forged or foreign manifest: refuse the plan, keep the connection's peer noted
            self.events("bad_manifest", peer=sender, why=str(exc)[:200])
            log.error("node %d: refusing plan from rank %d: %s", self.rank, sender, exc)
            return
        plan = Plan.from_json(msg["plan"], m, max_chunk_bytes=wire.MAX_CHUNK_BYTES)
        self.heartbeats.election.rival_claim(sender, plan.term)  # a plan from another node: it controls that term
        self.accept_plan(plan, m, raw_b, sender)

    def accept_plan(self, plan: Plan, m: mf.Manifest, raw: bytes, sender: int | None = None) -> None:
        """Take ``plan`` (of verified manifest ``m``, from controller ``sender``, None: this node) unless one of
        its version that wins over it (:meth:`_PlanState.order`) is known; start the workers it names this node
        for."""
        new = _PlanState(plan, m, raw, self.rank if sender is None else sender)
        old = self.plans.get(plan.version)
        if old is not None and old.order() >= new.order():
            return
        self.heartbeats.election.seen_term(plan.term)
        self.plans[plan.version] = new
        self.events("plan", v=plan.version, term=plan.term, seq=plan.seq, sender=new.sender, roots=plan.roots(),
                    slow=list(plan.slow), shard_roots=[s.root for s in plan.shards],
                    relays=sorted({r for s in plan.shards for r in s.order[1:] if s.children(r, plan.fanout)}))
        for sp in sorted(plan.shards, key=lambda s: s.fetch_rank):
            if self.rank in sp.order and not self.cache.has(sp.sha256):
                self.relay.ensure(sp.sha256, sp.size)
        # forget old plans (delivered long ago)
        if self.delivered is not None:
            for v in [v for v in self.plans if v < self.delivered - 64]:
                del self.plans[v]
        self.replanned()

    def _on_corrupt(self, st, why: str) -> None:
        """A cached shard was damaged and removed: counted, and fetched again if a plan still names us."""
        self.failure("integrity")
        self.events("cache_corrupt", sha=st.sha256[:16], why=why[:200])
        if self.plan_for(st.sha256) is not None:
            self.relay.ensure(st.sha256, st.size)
        self.replanned()

    def plan_for(self, sha: str):
        """The newest plan that has shard ``sha`` with this node in its tree: ``(ShardPlan, Plan, version)``."""
        for v in sorted(self.plans, reverse=True):
            ps = self.plans[v]
            for sp in ps.plan.shards:
                if sp.sha256 == sha and self.rank in sp.order:
                    return sp, ps.plan, ps.manifest
        return None

    # ------------------------------------------------------------------------------------- delivery

    def _next_version(self) -> int | None:
        if self.start_version is not None and (self.delivered is None or self.start_version > self.delivered + 1):
            return self.start_version
        if self.delivered is None:
            return None
        return self.delivered + 1

    async def _deliver_loop(self) -> None:
        while self.running:
            nxt = self._next_version()
            ps = self.plans.get(nxt) if nxt is not None else None
            if ps is not None and all(self.cache.has(s.sha256) for s in ps.manifest.shards):
                try:
                    if self.on_version_ready is not None:
                        await self.on_version_ready(ps.manifest)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - offered again later
                    log.exception("node %d: on_version_ready(%d) failed; retrying", self.rank, nxt)
                    self.events("deliver_error", v=nxt, why=str(exc)[:200])
                    await asyncio.sleep(self.cfg.heartbeat_s)
                    continue
                self.delivered = nxt
                self.stats["delivered"].append(nxt)
                self._save_delivered()
                self.events("delivered", v=nxt, kind=ps.manifest.kind, cpu_s=round(time.process_time(), 4),
                            shas=[s.sha256 for s in ps.manifest.shards], store_bytes=self.stats["store_bytes"],
                            store_bytes_v=self.stats["store_bytes_by_version"].get(nxt, 0))
                log.info("node %d: version %d ready", self.rank, nxt)
                continue
            await self.wait_pulse(self.cfg.heartbeat_s)


if __name__ == "__main__":  # ``python -m syncd.cluster.node``
    import sys

    from syncd.cluster.cli import main

    sys.exit(main())
