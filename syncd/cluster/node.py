"""One node of a syncd cluster: :class:`ClusterNode`, which runs inside a daemon's asyncio loop (settings:
:mod:`syncd.cluster.config`; the standalone process ``python -m syncd.cluster.node``, a node without engines
for tests and benchmarks: :mod:`syncd.cluster.cli`).

What a node does (see ``docs/cluster.md``):

* listens for authenticated connections (:mod:`syncd.cluster.auth`): *control* connections carry
  heartbeats and plans, *data* connections carry pulls of shards (:mod:`syncd.cluster.transfer`);
* sends a heartbeat to every other member every ``heartbeat_s``: its incarnation, the highest controller
  term it has seen, its delivered version, which shards of the versions in flight it holds, and the rates it
  receives at from each parent; the controller's heartbeat also carries the version each new node starts at;
* runs the election (:mod:`syncd.cluster.election`); while it is the controller
  (:mod:`syncd.cluster.controller`) it polls the store for new versions (conditional GET of
  ``latest.json``), plans every version some live node still needs
  (:mod:`syncd.cluster.planner`), and sends each plan, with the signed manifest, to the nodes in it --
  again whenever membership or the set of slow nodes changes;
* for every shard of a plan it is in (:mod:`syncd.cluster.fetching`): reads it from the store if it is
  the shard's root (paced: at most ``store_streams`` shards are read at once, cluster-wide), else pulls
  it from its parent in the shard's tree, moving up the tree (grandparent, ..., root) when the parent dies or stalls, then to any live node
  holding it, and to the store only as a last resort -- always resuming at the first chunk it lacks;
* calls ``on_version_ready(manifest)`` once every shard of a version is in its cache, in version order,
  never skipping or repeating one.

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
import json
import logging
import os
import secrets
import time
from dataclasses import dataclass

from syncd import manifest as mf
from syncd.cache import ShardCache
from syncd.cluster import auth, membership, transfer, wire
from syncd.cluster.auth import ClusterSecret
from syncd.cluster.config import NO_HISTORY, ClusterConfig
from syncd.cluster.controller import ControllerRole
from syncd.cluster.election import Election
from syncd.cluster.errors import AuthError, ClusterError, ProtocolError
from syncd.cluster.fetching import ShardFetching, SourceRate
from syncd.cluster.membership import Member, Membership
from syncd.cluster.partials import PartialShards
from syncd.cluster.planner import Plan
from syncd.cluster.wire import T
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


class EventLog:
    """Appends one JSON object per line to a file (for tests and benchmarks); no-op without a path."""

    def __init__(self, path=None):
        self._fh = open(path, "a", buffering=1) if path else None

    def __call__(self, ev: str, **kw) -> None:
        if self._fh is not None:
            self._fh.write(json.dumps({"ev": ev, "t": time.time(), **kw}, default=str) + "\n")

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()


class ClusterNode(ShardFetching, ControllerRole):
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
        self.state_path = os.path.join(self.cache.root, "cluster", "state.json")
        self.on_version_ready = on_version_ready
        if delivered is not None and delivered < 0 and delivered != NO_HISTORY:
            raise ValueError(f"delivered must be a version, None or NO_HISTORY, not {delivered}")
        self.delivered = (None if delivered == NO_HISTORY else delivered if delivered is not None
                          else self._load_delivered())
        self.start_version: int | None = None
        self.inc = secrets.token_hex(8)
        self.events = EventLog(events)
        self.stats = {"refused_connections": 0, "bad_frames": 0, "store_bytes": 0, "store_bytes_by_version": {},
                      "served_bytes": 0, "served_chunks": 0, "received_bytes": 0, "received_chunks": 0,
                      "switches": 0, "delivered": [], "failures": {}}
        self._failures_hook = failures
        self.supervisor = Supervisor(f"cluster node {self.rank}", on_failure=self._failure, on_error=self._task_error,
                                     logger=log)
        self.plans: dict[int, _PlanState] = {}
        self.membership: Membership | None = None
        self.election: Election | None = None
        self._ctrl_out: dict[int, wire.Channel] = {}
        self._dialing: dict[int, asyncio.Task] = {}
        self._workers: dict[str, asyncio.Task] = {}
        self._rates: dict[int, SourceRate] = {}
        self._stalled: dict[int, float] = {}
        self._tasks: set[asyncio.Task] = set()  # connection watchers
        self._server = None
        self._running = False
        self._pulse_fut: asyncio.Future | None = None
        self._replan_fut: asyncio.Future | None = None
        self._pull_sem: asyncio.Semaphore | None = None
        self._throttle = transfer.Throttle(config.throttle_bps)
        self._pool = transfer.PeerPool(lambda r: self._dial(r, "data"))
        # controller state (rebuilt from shared state on takeover)
        self._manifests: dict[int, tuple[bytes, mf.Manifest]] = {}
        self._etag: str | None = None
        self._latest: int | None = None
        self._sent: dict[tuple, tuple] = {}
        self._bad: dict[int, str] = {}  # version -> why its manifest is unusable
        self._missing: dict[int, float] = {}  # version -> when a listing found no manifest there
        self._listed_at = float("-inf")
        self._bad_hint: bytes | None = None
        self._starts: dict[tuple, int] = {}
        self._slow: dict[int, tuple[float, int]] = {}
        self._seq = 0
        self._ctrl_wake: asyncio.Event | None = None

    # ------------------------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Bind the listening socket and start every background task; returns once listening. Raises
        ``OSError`` if the address cannot be bound."""
        cfg = self.cfg
        loop = asyncio.get_running_loop()
        self._pulse_fut = loop.create_future()
        self._replan_fut = loop.create_future()
        self._pull_sem = asyncio.Semaphore(cfg.pull_window)
        self._ctrl_wake = asyncio.Event()
        members = dict(cfg.peers or {})
        if cfg.cluster_id is not None and cfg.advertise is not None:
            members[self.rank] = Member(self.rank, cfg.advertise[0], int(cfg.advertise[1]))
        if self.rank not in members:
            raise ValueError(f"rank {self.rank} has no address (not in the peer list, no advertise)")
        self.membership = Membership(self.rank, members, dead_after_s=cfg.dead_after_s)
        self.election = Election(self.rank, grace_s=cfg.dead_after_s, started=time.monotonic())
        me = members[self.rank]
        host, port = cfg.listen or (me.host, me.port)
        self._server = await asyncio.start_server(self._accept, host, port, limit=1 << 20, reuse_address=True)
        self.cache.on_complete = lambda st: self._pulse()
        self.cache.on_corrupt = self._on_corrupt
        self._running = True
        self.supervisor.spawn("heartbeat", self._heartbeat_loop)
        self.supervisor.spawn("controller", self._controller_loop)
        self.supervisor.spawn("deliver", self._deliver_loop)
        if cfg.cluster_id is not None:
            self.supervisor.spawn("discover", self._discover_loop)
        self.events("start", rank=self.rank, inc=self.inc, delivered=self.delivered, pid=os.getpid())
        log.info("cluster node %d listening on %s:%d (incarnation %s)", self.rank, host, port, self.inc)

    async def stop(self) -> None:
        """Stop every task and close every connection (idempotent)."""
        if not self._running:
            return
        self._running = False
        if self._server is not None:
            self._server.close()
        await self.supervisor.stop()
        tasks = [*self._tasks, *self._workers.values(), *self._dialing.values()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for ch in self._ctrl_out.values():
            ch.close()
        self._pool.close()
        self.events("stop", rank=self.rank)
        self.events.close()

    @property
    def is_controller(self) -> bool:
        return self.election is not None and self.election.is_controller

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
        ``skipped_versions`` (``{version: why}`` of the unusable versions the controller skipped, newest 16).
        Call from the node's loop (or accept a value a moment old from another thread)."""
        st = self.stats
        mem, el = self.membership, self.election
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
                "skipped_versions": {str(v): why for v, why in sorted(self._bad.items())[-16:]}}

    def _failure(self, kind: str) -> None:
        """Count one failure of ``kind`` (here and in the ``failures`` hook)."""
        self.stats["failures"][kind] = self.stats["failures"].get(kind, 0) + 1
        if self._failures_hook is not None:
            self._failures_hook(kind)

    def _task_error(self, name: str, exc: BaseException) -> None:
        self.events("task_error", task=name, why=f"{type(exc).__name__}: {exc}"[:300])

    def _pulse(self) -> None:
        """Wake everything that waits for progress (a chunk, a shard, a plan, a heartbeat)."""
        if self._pulse_fut is not None and not self._pulse_fut.done():
            self._pulse_fut.set_result(None)
        self._pulse_fut = asyncio.get_running_loop().create_future()

    def _replanned(self) -> None:
        """Wake the pulls that must check whether their source is still the right one."""
        if not self._replan_fut.done():
            self._replan_fut.set_result(None)
        self._replan_fut = asyncio.get_running_loop().create_future()
        self._pulse()

    async def _wait_pulse(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(self._pulse_fut), timeout)
        except asyncio.TimeoutError:
            pass

    def _load_delivered(self) -> int | None:
        try:
            with open(self.state_path, "rb") as fh:
                raw = fh.read(4097)
            doc = wire.parse_json(raw, self.state_path, max_bytes=4096)
        except FileNotFoundError:
            return None
        except (OSError, ProtocolError) as exc:
            log.warning("node %d: ignoring the state file: %s", self.rank, exc)
            return None
        v = doc.get("delivered")
        if (doc.get("run_id") == self.run_id and isinstance(v, int) and not isinstance(v, bool)
                and 0 <= v <= mf.MAX_VERSION):
            return v
        return None

    def _save_delivered(self) -> None:
        """Record the delivered version (best effort: a failure is logged and counted; the next delivery
        writes the file again, and a restart without it starts at the newest full version)."""
        tmp = self.state_path + ".tmp"
        try:
            os.makedirs(os.path.dirname(self.state_path), exist_ok=True)
            with open(tmp, "w") as fh:
                json.dump({"run_id": self.run_id, "delivered": self.delivered}, fh)
            os.replace(tmp, self.state_path)
        except OSError as exc:
            log.error("node %d: cannot record delivered version %s in %s: %s", self.rank, self.delivered,
                      self.state_path, exc)
            self.events("state_error", v=self.delivered, why=str(exc)[:200])
            self._failure("cache")

    # ------------------------------------------------------------------------------------- connections

    async def _dial(self, rank: int, role: str) -> wire.Channel:
        m = self.membership.members.get(rank)
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
                await self._control_reader(chan)
            else:
                await self._data_server(chan)
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

    async def _control_reader(self, chan: wire.Channel) -> None:
        while True:
            f = await chan.recv()
            if f.type == T.HEARTBEAT:
                self._on_heartbeat(chan.peer, f.json())
            elif f.type == T.PLAN:
                await self._on_plan(chan.peer, f.json())
            else:
                raise ProtocolError(f"unexpected {f.type.name} on a control connection")

    async def _data_server(self, chan: wire.Channel) -> None:
        while True:
            f = await chan.recv()
            if f.type != T.PULL:
                raise ProtocolError(f"unexpected {f.type.name} on a data connection")
            await transfer.serve_pull(chan, f.json(), self.cache, lookup=self._lookup,
                                      keepalive_s=self.cfg.heartbeat_s, chunk_bytes=self.cfg.chunk_bytes,
                                      throttle=self._throttle, stats=self.stats)

    async def _lookup(self, sha: str, size: int):
        """The shard state to serve, waiting briefly for a plan that names it (it may arrive after a
        child's request). None if this node neither holds nor expects it."""
        deadline = time.monotonic() + 2 * self.cfg.heartbeat_s
        while True:
            st = self.cache.get(sha)
            if st is not None and (st.complete or st.busy or st.chunk_bytes is not None):
                return st
            if sha in self._workers and not self._workers[sha].done():
                return self.cache.state(sha, size)
            if time.monotonic() >= deadline:
                return None
            await self._wait_pulse(deadline - time.monotonic())

    # ------------------------------------------------------------------------------------- heartbeats

    def _partial(self) -> dict[str, int]:
        """``{sha256: verified bytes}`` of the shards this node holds in part (at most 256)."""
        out = {}
        for sha, st in self.cache.states.items():
            if not st.complete and st.have and st.chunk_bytes and len(out) < 256:
                out[sha] = min(st.have * st.chunk_bytes, st.size)
        return out

    def _holding(self) -> dict:
        out = {}
        for v, ps in self.plans.items():
            if self.delivered is not None and v <= self.delivered:
                continue
            bits = 0
            for i, s in enumerate(ps.manifest.shards):
                if self.cache.has(s.sha256):
                    bits |= 1 << i
            out[str(v)] = format(bits, "x")
        return out

    def _heartbeat(self) -> dict:
        now = time.monotonic()
        hb = {"rank": self.rank, "inc": self.inc, "term": self.election.max_term,
              "ctrl": self.election.controller if self.election.controller is not None else -1,
              "delivered": -1 if self.delivered is None else self.delivered,
              "start": -1 if self.start_version is None else self.start_version,
              "hold": self._holding(), "part": self._partial(),
              "rates": {str(r): int(x.rate) for r, x in self._rates.items() if x.secs >= 0.5},
              "stalled": [r for r, t in self._stalled.items() if now - t < 30]}
        if self.is_controller:
            hb["starts"] = {str(r): v for (r, inc), v in self._starts.items()
                            if self.membership.peers.get(r) is not None and self.membership.peers[r].incarnation == inc}
            hb["latest"] = -1 if self._latest is None else self._latest
        return hb

    def _on_heartbeat(self, rank: int, hb: dict) -> None:
        if hb.get("rank") != rank or not isinstance(hb.get("inc"), str) or len(hb["inc"]) > 64:
            raise ProtocolError(f"heartbeat from rank {rank} names rank {str(hb.get('rank'))[:20]}")
        for k in ("term", "ctrl", "delivered", "start"):
            if not isinstance(hb.get(k), int) or isinstance(hb.get(k), bool):
                raise ProtocolError(f"heartbeat from rank {rank}: {k} is not an integer")
        for k, typ in (("hold", dict), ("part", dict), ("rates", dict), ("stalled", list), ("starts", dict)):
            if k in hb and not isinstance(hb[k], typ):
                raise ProtocolError(f"heartbeat from rank {rank}: {k} is not a JSON {typ.__name__}")
        before = set(self.membership.live())
        if self.membership.heard(rank, hb):
            self.events("peer_restarted", peer=rank)
        self.election.seen_term(hb["term"])
        if hb["ctrl"] == rank and isinstance(hb.get("starts"), dict):
            mine = hb["starts"].get(str(self.rank))
            if isinstance(mine, int) and mine >= 0 and self._adopt_start(mine):
                self._pulse()
        if set(self.membership.live()) != before:
            self._on_membership_change()

    def _adopt_start(self, v: int) -> bool:
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

    def _on_membership_change(self) -> None:
        live = self.membership.live()
        self.events("live", live=live)
        if self._ctrl_wake is not None:
            self._ctrl_wake.set()
        self._replanned()

    async def _heartbeat_loop(self) -> None:
        cfg = self.cfg
        while self._running:
            before = set(self.membership.live())
            ctrl, became = self.election.evaluate(self.membership.live(), time.monotonic())
            if became:
                self.events("controller", term=self.election.term)
                self._rebuild_controller_state()
                self._ctrl_wake.set()
            payload = wire.dump_json(self._heartbeat())
            await asyncio.gather(*(self._send_control(r, T.HEARTBEAT, payload)
                                   for r in self.membership.members if r != self.rank), return_exceptions=True)
            await asyncio.sleep(cfg.heartbeat_s)
            if set(self.membership.live()) != before:
                self._on_membership_change()

    async def _send_control(self, rank: int, t: T, payload: bytes) -> bool:
        ch = self._ctrl_out.get(rank)
        if ch is None or ch.closed:
            if rank not in self._dialing or self._dialing[rank].done():
                self._dialing[rank] = asyncio.create_task(self._dial_control(rank))
            return False
        try:
            await asyncio.wait_for(ch.send(t, payload), max(self.cfg.heartbeat_s, 5.0 if t == T.PLAN else 0))
            return True
        except (OSError, asyncio.TimeoutError):
            ch.close()
            self._ctrl_out.pop(rank, None)
            return False

    async def _dial_control(self, rank: int) -> None:
        try:
            ch = await self._dial(rank, "control")
        except (OSError, asyncio.TimeoutError, ClusterError, asyncio.IncompleteReadError) as exc:
            log.debug("node %d: control connection to rank %d failed: %s", self.rank, rank, exc)
            await asyncio.sleep(self.cfg.heartbeat_s)
            return
        except Exception as exc:  # noqa: BLE001 -- reported; the next heartbeat dials again
            self.supervisor.failed(f"dial rank {rank}", exc, kind="connection")
            await asyncio.sleep(self.cfg.heartbeat_s)
            return
        old = self._ctrl_out.get(rank)
        if old is not None:
            old.close()
        self._ctrl_out[rank] = ch
        # the peer never sends on our outgoing connection; reading just notices when it goes away
        watcher = asyncio.create_task(self._watch(ch))
        self._tasks.add(watcher)
        watcher.add_done_callback(self._tasks.discard)

    async def _watch(self, ch: wire.Channel) -> None:
        try:
            await ch.reader.read(1)
        except Exception:  # noqa: BLE001
            pass
        ch.close()
        if self._ctrl_out.get(ch.peer) is ch:
            del self._ctrl_out[ch.peer]

    async def _discover_loop(self) -> None:
        me = self.membership.members[self.rank]
        while self._running:
            try:
                await asyncio.to_thread(membership.register, self.store, self.cfg.cluster_id, me, self.inc, self.secret)
                found = await asyncio.to_thread(membership.discover, self.store, self.cfg.cluster_id, self.secret)
                new = self.membership.add(found)
                for r in new:
                    self.events("member", peer=r)
                    ch = self._ctrl_out.pop(r, None)
                    if ch is not None:
                        ch.close()
            except (SyncdError, OSError) as exc:
                log.warning("node %d: store directory discovery failed: %s", self.rank, exc)
                self._failure("store")
            await asyncio.sleep(self.cfg.discover_s)

    # ------------------------------------------------------------------------------------- plans

    async def _on_plan(self, sender: int, msg: dict) -> None:
        raw = msg.get("manifest")
        if not isinstance(raw, str) or not isinstance(msg.get("plan"), dict):
            raise ProtocolError("PLAN without manifest and plan")
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
        self._accept_plan(plan, m, raw_b)

    def _accept_plan(self, plan: Plan, m: mf.Manifest, raw: bytes) -> None:
        old = self.plans.get(plan.version)
        if old is not None and (old.plan.term, old.plan.seq) >= (plan.term, plan.seq):
            return
        self.election.seen_term(plan.term)
        self.plans[plan.version] = _PlanState(plan, m, raw)
        self.events("plan", v=plan.version, term=plan.term, seq=plan.seq, roots=plan.roots(), slow=list(plan.slow),
                    shard_roots=[s.root for s in plan.shards],
                    relays=sorted({r for s in plan.shards for r in s.order[1:] if s.children(r, plan.fanout)}))
        for sp in sorted(plan.shards, key=lambda s: s.fetch_rank):
            if self.rank in sp.order and not self.cache.has(sp.sha256):
                self._ensure_worker(sp.sha256, sp.size)
        # forget old plans (delivered long ago)
        if self.delivered is not None:
            for v in [v for v in self.plans if v < self.delivered - 64]:
                del self.plans[v]
        self._replanned()

    def _ensure_worker(self, sha: str, size: int) -> None:
        w = self._workers.get(sha)
        if w is None or w.done():
            self._workers[sha] = asyncio.create_task(self._shard_worker(sha, size))

    def _on_corrupt(self, st, why: str) -> None:
        """A cached shard was damaged and removed: counted, and fetched again if a plan still names us."""
        self._failure("integrity")
        self.events("cache_corrupt", sha=st.sha256[:16], why=why[:200])
        if self._plan_for(st.sha256) is not None:
            self._ensure_worker(st.sha256, st.size)
        self._replanned()

    def _plan_for(self, sha: str):
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
        while self._running:
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
            await self._wait_pulse(self.cfg.heartbeat_s)


if __name__ == "__main__":  # ``python -m syncd.cluster.node``
    import sys

    from syncd.cluster.cli import main

    sys.exit(main())
