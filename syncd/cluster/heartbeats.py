"""The membership role of a cluster node (:class:`Heartbeats`, held by :class:`~syncd.cluster.node.ClusterNode`):
who is in the cluster and alive (:class:`~syncd.cluster.membership.Membership`), who is the controller
(:class:`~syncd.cluster.election.Election`, or with ``--etcd`` :class:`~syncd.cluster.etcd_election.EtcdElection`),
and the control connections that carry heartbeats and plans.

Every ``heartbeat_s`` a node sends every other member a heartbeat: its incarnation, the highest controller
term it has seen, its delivered version, which shards of the versions in flight it holds (``hold``) and in
part (``part``), the rates it receives at from each parent and the parents that stalled; the controller's
heartbeat also carries the version each new node starts at (``starts``) and the newest verified version
(``latest``). A heartbeat that claims the controller role with a term older than the newest this node has seen
is refused (its commands too; with etcd, see :meth:`~syncd.cluster.etcd_election.EtcdElection.is_stale`).
Members come from the static peer list, the store directory (``discover_s``) or etcd. Runs on the node's event
loop (store reads in worker threads).
"""

from __future__ import annotations

import asyncio
import logging
import time

from syncd.cluster import membership, wire
from syncd.cluster.election import Election
from syncd.cluster.errors import ClusterError, ProtocolError
from syncd.cluster.membership import Member, Membership
from syncd.cluster.wire import T
from syncd.errors import SyncdError

log = logging.getLogger("syncd.cluster.node")

__all__ = ["Heartbeats"]


class Heartbeats:
    """The membership role of ``node`` (see the module docstring); made by :meth:`ClusterNode.start`, which
    has bound the node's address. ``members``: the initial members (this node included)."""

    def __init__(self, node, members: dict[int, Member]):
        cfg = node.cfg
        self.node = node
        self.membership = Membership(node.rank, members, dead_after_s=cfg.dead_after_s)
        if cfg.etcd:
            from syncd.cluster.etcd_election import EtcdElection

            self.election = EtcdElection(node, endpoint=cfg.etcd, ttl_s=cfg.etcd_ttl_s,
                                         cluster=cfg.cluster_id or node.run_id)
        else:
            self.election = Election(node.rank, grace_s=cfg.dead_after_s, started=time.monotonic())
        self._out: dict[int, wire.Channel] = {}  # our control connection to each peer (we only send on it)
        self._dialing: dict[int, asyncio.Task] = {}
        self._watchers: set[asyncio.Task] = set()

    def close(self) -> list[asyncio.Task]:
        """Close the control connections; the tasks still to cancel and await."""
        for ch in self._out.values():
            ch.close()
        return [*self._watchers, *self._dialing.values()]

    # ------------------------------------------------------------------------------------- sending

    def heartbeat(self) -> dict:
        """This node's heartbeat (also what the controller reads for itself)."""
        node, now = self.node, time.monotonic()
        hb = {"rank": node.rank, "inc": node.inc, "term": self.election.max_term,
              "ctrl": self.election.controller if self.election.controller is not None else -1,
              "delivered": -1 if node.delivered is None else node.delivered,
              "start": -1 if node.start_version is None else node.start_version,
              "hold": self._holding(), "part": node.relay.partial(),
              "rates": {str(r): int(x.rate) for r, x in node.relay.rates.items() if x.secs >= 0.5},
              "stalled": [r for r, t in node.relay.stalled.items() if now - t < 30]}
        if self.election.is_controller:
            hb.update(node.controller.heartbeat_fields())
        return hb

    def _holding(self) -> dict:
        """``{version: hex bitmap of the shards held}`` of the versions in flight (for heartbeats)."""
        node = self.node
        out = {}
        for v, ps in node.plans.items():
            if node.delivered is not None and v <= node.delivered:
                continue
            bits = 0
            for i, s in enumerate(ps.manifest.shards):
                if node.cache.has(s.sha256):
                    bits |= 1 << i
            out[str(v)] = format(bits, "x")
        return out

    async def loop(self) -> None:
        """Supervised: evaluate the election, send heartbeats, notice membership changes, every ``heartbeat_s``."""
        node = self.node
        while node.running:
            before = set(self.membership.live())
            self.elect()
            payload = wire.dump_json(self.heartbeat())
            await asyncio.gather(*(self.send(r, T.HEARTBEAT, payload)
                                   for r in self.membership.members if r != node.rank), return_exceptions=True)
            await asyncio.sleep(node.cfg.heartbeat_s)
            if set(self.membership.live()) != before:
                self.membership_changed()

    def elect(self) -> None:
        """Evaluate the election now (each heartbeat, and when etcd's election changes); on a takeover the
        controller role continues from shared state."""
        _, became = self.election.evaluate(self.membership.live(), time.monotonic())
        if became:
            self.node.events("controller", term=self.election.term)
            self.node.controller.take_over()

    async def send(self, rank: int, t: T, payload: bytes) -> bool:
        """Send one control frame to ``rank`` (dialing it in the background if there is no connection yet);
        False if it did not go out."""
        ch = self._out.get(rank)
        if ch is None or ch.closed:
            if rank not in self._dialing or self._dialing[rank].done():
                self._dialing[rank] = asyncio.create_task(self._dial(rank))
            return False
        try:
            await asyncio.wait_for(ch.send(t, payload), max(self.node.cfg.heartbeat_s, 5.0 if t == T.PLAN else 0))
            return True
        except (OSError, asyncio.TimeoutError):
            ch.close()
            self._out.pop(rank, None)
            return False

    async def _dial(self, rank: int) -> None:
        node = self.node
        try:
            ch = await node.dial(rank, "control")
        except (OSError, asyncio.TimeoutError, ClusterError, asyncio.IncompleteReadError) as exc:
            log.debug("node %d: control connection to rank %d failed: %s", node.rank, rank, exc)
            await asyncio.sleep(node.cfg.heartbeat_s)
            return
        except Exception as exc:  # noqa: BLE001 -- reported; the next heartbeat dials again
            node.supervisor.failed(f"dial rank {rank}", exc, kind="connection")
            await asyncio.sleep(node.cfg.heartbeat_s)
            return
        old = self._out.get(rank)
        if old is not None:
            old.close()
        self._out[rank] = ch
        # the peer never sends on our outgoing connection; reading just notices when it goes away
        watcher = asyncio.create_task(self._watch(ch))
        self._watchers.add(watcher)
        watcher.add_done_callback(self._watchers.discard)

    async def _watch(self, ch: wire.Channel) -> None:
        try:
            await ch.reader.read(1)
        except Exception:  # noqa: BLE001
            pass
        ch.close()
        if self._out.get(ch.peer) is ch:
            del self._out[ch.peer]

    # ------------------------------------------------------------------------------------- receiving

    async def read(self, chan: wire.Channel) -> None:
        """Serve an accepted control connection: heartbeats here, plans to the node. Raises
        :class:`ProtocolError` for anything else."""
        while True:
            f = await chan.recv()
            if f.type == T.HEARTBEAT:
                self._on_heartbeat(chan.peer, f.json())
            elif f.type == T.PLAN:
                await self.node.on_plan(chan.peer, f.json())
            else:
                raise ProtocolError(f"unexpected {f.type.name} on a control connection")

    def _on_heartbeat(self, rank: int, hb: dict) -> None:
        if hb.get("rank") != rank or not isinstance(hb.get("inc"), str) or len(hb["inc"]) > 64:
            raise ProtocolError(f"heartbeat from rank {rank} names rank {str(hb.get('rank'))[:20]}")
        for k in ("term", "ctrl", "delivered", "start"):
            if not isinstance(hb.get(k), int) or isinstance(hb.get(k), bool):
                raise ProtocolError(f"heartbeat from rank {rank}: {k} is not an integer")
        for k, typ in (("hold", dict), ("part", dict), ("rates", dict), ("stalled", list), ("starts", dict)):
            if k in hb and not isinstance(hb[k], typ):
                raise ProtocolError(f"heartbeat from rank {rank}: {k} is not a JSON {typ.__name__}")
        node = self.node
        before = set(self.membership.live())
        if self.membership.heard(rank, hb):
            node.events("peer_restarted", peer=rank)
        if hb["ctrl"] != rank:
            self.election.seen_term(hb["term"])
        elif self.election.is_stale(hb["term"]):  # a deposed controller's claim and commands
            node.refuse_stale("heartbeat", rank, hb["term"])
        else:
            self.election.rival_claim(rank, hb["term"])
            mine = hb["starts"].get(str(node.rank)) if isinstance(hb.get("starts"), dict) else None
            if isinstance(mine, int) and mine >= 0 and node.adopt_start(mine):
                node.pulse()
        if set(self.membership.live()) != before:
            self.membership_changed()

    def membership_changed(self) -> None:
        live = self.membership.live()
        self.node.events("live", live=live)
        self.node.controller.wake()
        self.node.replanned()

    def merge_members(self, found: dict[int, Member]) -> None:
        """Take members found in the store directory or etcd: a new or moved one is dialed afresh."""
        for r in self.membership.add(found):
            self.node.events("member", peer=r)
            ch = self._out.pop(r, None)
            if ch is not None:
                ch.close()

    async def discover_loop(self) -> None:
        """Supervised: register this node in the store directory and read the others, every ``discover_s``."""
        node = self.node
        me = self.membership.members[node.rank]
        while node.running:
            try:
                await asyncio.to_thread(membership.register, node.store, node.cfg.cluster_id, me, node.inc,
                                        node.secret)
                found = await asyncio.to_thread(membership.discover, node.store, node.cfg.cluster_id, node.secret)
                self.merge_members(found)
            except (SyncdError, OSError) as exc:
                log.warning("node %d: store directory discovery failed: %s", node.rank, exc)
                node.failure("store")
            await asyncio.sleep(node.cfg.discover_s)
