"""The controller elected through etcd, and membership as one etcd lease per node (``--etcd URL``; without it the
cluster uses its embedded election, :mod:`syncd.cluster.election`). :class:`EtcdElection` is the
:class:`~syncd.cluster.heartbeats.Heartbeats` role's election then; the etcd calls are :mod:`syncd.cluster.etcd`.

**Membership.** Each node holds one lease of ``etcd_ttl_s`` seconds, kept alive every third of it, and under it
its member record (:func:`syncd.cluster.membership.record`, MAC'd with the cluster secret) at
``syncd/clusters/<cluster>/members/<rank:06d>``. A node is a member while its lease lives: every heartbeat each
node reads the records (new addresses join the member list) and a node whose record is gone is not live
(:attr:`syncd.cluster.membership.Membership.registered`), whatever the heartbeats say.

**Election.** Each node stands (``v3election`` campaign) in ``syncd/clusters/<cluster>/controller`` under its
lease, with the value ``{"rank", "inc", "mac"}``. etcd gives the lead to the living candidate whose key is the
oldest. The **term** of a controller is its key's creation revision: every later leader's is higher (a key
created later has a higher revision, and the leader is the oldest living key), so terms order controllers
without any node's clock, and no two controllers ever share one.

**Fencing.** Every plan and every controller heartbeat (its claim and its commands: the start versions of new
nodes) carries the sender's term; a node refuses (:meth:`EtcdElection.is_stale`, a ``stale_refused`` event) any
whose term is lower than the newest it has seen -- in etcd (every heartbeat each node reads the election's
leader), in a plan or in a heartbeat. The controller acts only while its lease is surely alive: until
``sent + TTL`` of its last acknowledged keepalive (etcd counts the TTL from when it received that keepalive,
which is later). It steps down at that deadline (etcd unreachable: a controller cut off with a minority of the
cluster stops before etcd can elect another), when a keepalive finds the lease gone, when etcd names another
leader, or when a peer shows a higher term. A process stalled between its check and its send (SIGSTOP, a long
pause) can still send a plan of its old term: the receivers' fencing is what refuses it. A node that lost its
lease revokes it as soon as etcd answers (its keys go at once: an etcd that restarts would keep it alive for
another TTL), takes a new one and stands again.

While etcd cannot be reached nobody becomes controller; followers keep the controller they last knew. etcd's
data must persist across its restarts: its revisions are the terms (an etcd that restarts empty starts its
revisions again, seen as a new cluster id: each node then forgets the terms it has seen).

Tasks: :meth:`EtcdElection.loops` (``etcd_session``: lease, record, campaign, keepalive; ``etcd_watch``: leader
and members every heartbeat), run under the node's supervisor. etcd failures are expected (restarts,
partitions): each is counted (``failures{kind="etcd"}``), logged once per outage (an ``etcd_error`` event, and
``etcd_ok`` when it answers again) and retried; anything else is a task failure the supervisor restarts.

Used from the node's event loop only (not thread-safe).
"""

from __future__ import annotations

import asyncio
import logging
import time

from syncd.cluster import membership, wire
from syncd.cluster.errors import EtcdError, LeaseNotFound, ProtocolError
from syncd.cluster.etcd import EtcdClient, Lease, LeaderKey

log = logging.getLogger("syncd.cluster.node")

__all__ = ["EtcdElection", "key_prefix"]

_VALUE_LABEL = b"syncd.cluster.leader.v1"


def key_prefix(cluster: str) -> bytes:
    """The etcd keys of cluster ``cluster``: ``syncd/clusters/<cluster>/``."""
    return f"syncd/clusters/{membership.check_cluster_id(cluster)}/".encode()


class EtcdElection:
    """The etcd election and lease of ``node`` (see the module docstring), with the interface of
    :class:`syncd.cluster.election.Election`: :attr:`controller` (rank or None), :attr:`term` (the term this
    node controls while it does), :attr:`max_term` (the newest term seen), :attr:`is_controller`,
    :meth:`evaluate`, :meth:`seen_term`, :meth:`rival_claim`, :meth:`is_stale`, :meth:`loops`, :meth:`close`.
    ``cluster``: the name of the cluster's keys in etcd; ``ttl_s``: the lease's TTL in whole seconds."""

    def __init__(self, node, *, endpoint: str, ttl_s: int, cluster: str):
        self.node, self.me = node, node.rank
        self.ttl_s = ttl_s
        self.client = EtcdClient(endpoint, timeout_s=max(1.0, ttl_s / 3))
        prefix = key_prefix(cluster)
        self.election_name = prefix + b"controller"
        self.members_prefix = prefix + b"members/"
        self.controller: int | None = None
        self.term = 0
        self.max_term = 0
        self.lease: Lease | None = None
        self._orphans: set[int] = set()  # leases lost but maybe alive at etcd: revoked when it answers
        self._leading: LeaderKey | None = None
        self._won_at = 0  # the store revision at which the lead was confirmed
        self._reported = True
        self._deadline = float("-inf")  # monotonic time until which our lease is surely alive at etcd
        self._deposed = asyncio.Event()
        self._failing: set[str] = set()  # etcd calls failing now (logged once per outage)
        self._bad_records: set[tuple[bytes, int]] = set()
        self._cluster_id: int | None = None

    # ------------------------------------------------------------------------------------- the election's interface

    @property
    def is_controller(self) -> bool:
        """This node leads in etcd and its lease is surely alive now."""
        return self._leading is not None and time.monotonic() < self._deadline

    def seen_term(self, term: int) -> None:
        """A term announced by etcd, a plan or a heartbeat."""
        if isinstance(term, int) and not isinstance(term, bool) and term > self.max_term:
            self.max_term = term

    def is_stale(self, term) -> bool:
        """A plan or controller heartbeat of ``term`` is refused: a newer term has been seen."""
        return isinstance(term, int) and term < self.max_term

    def rival_claim(self, rank: int, term: int) -> None:
        """Peer ``rank`` sent a plan or claims the controller role with ``term`` (not stale): it is the newest
        controller known when its term is; this node steps down if it controls an older term."""
        if not isinstance(term, int) or isinstance(term, bool) or rank == self.me:
            return
        if term > self.max_term or (term == self.max_term and self._leading is None):
            self.controller = rank
        self.seen_term(term)
        if self._leading is not None and term > self.term:
            self._step_down(f"rank {rank} controls the newer term {term}")

    def evaluate(self, live: list[int], now: float) -> tuple[int | None, bool]:
        """``(controller, became)`` as :meth:`syncd.cluster.election.Election.evaluate` (``live`` is not
        used: etcd decides); steps down if the lease's deadline has passed."""
        if self._leading is not None and now >= self._deadline:
            self._step_down("no keepalive acknowledged within the lease's TTL (etcd unreachable, or this "
                            "process was stalled)")
        became = self._leading is not None and not self._reported
        self._reported = True
        if self._leading is not None:
            return self.me, became
        return (None if self.controller == self.me else self.controller), became

    def loops(self) -> dict:
        """The long-lived tasks to run under the node's supervisor: ``{name: coroutine function}``."""
        return {"etcd_session": self.session_loop, "etcd_watch": self.watch_loop}

    async def close(self) -> None:
        """Revoke this node's lease (its record and candidacy go at once; a successor need not wait for the
        TTL). Best effort, bounded by a second: a failure is logged."""
        lease, self.lease = self.lease, None
        self._step_down("the node stops", level=logging.INFO)
        if lease is not None:
            try:
                await self.client.revoke(lease.id, timeout_s=1.0)
            except EtcdError as exc:
                log.info("node %d: could not revoke etcd lease %x on stopping: %s", self.me, lease.id, exc)

    # ------------------------------------------------------------------------------------- the session

    async def session_loop(self) -> None:
        """Supervised: take a lease, register, stand, keep the lease alive; again whenever the lease is lost."""
        node = self.node
        backoff = 0.25
        while node.running:
            try:
                lease = await self._open_lease()
            except EtcdError as exc:
                self._etcd_failed("lease grant", exc)
                await asyncio.sleep(backoff)
                backoff = min(self.ttl_s / 2, 2 * backoff)
                continue
            backoff = 0.25
            why = await self._hold(lease)
            self._step_down(f"lease lost: {why}")
            self._deadline = float("-inf")
            node.events("etcd_lease_lost", lease=format(lease.id, "x"), why=why[:200])
            log.warning("node %d: etcd lease %x lost: %s", self.me, lease.id, why)
            self.lease = None
            self._orphans.add(lease.id)
            await self._revoke_orphans()

    async def _revoke_orphans(self) -> None:
        """Revoke the leases this node lost (best effort, until etcd answers): an etcd that restarts keeps its
        leases alive for another TTL, and an old candidacy would hold the lead that long. The session and
        the watch both call it (one may find a lease the other revoked meanwhile)."""
        for lease_id in sorted(self._orphans):
            try:
                await self.client.revoke(lease_id, timeout_s=1.0)
            except EtcdError:
                return  # unreachable: again before the next lease
            self._orphans.discard(lease_id)

    async def _open_lease(self) -> Lease:
        node = self.node
        await self._revoke_orphans()
        sent = time.monotonic()
        lease = await self.client.grant(self.ttl_s)
        self._deadline = sent + lease.ttl
        me = node.heartbeats.membership.members[self.me]
        try:
            await self.client.put(self._member_key(self.me), membership.record(me, node.inc, node.secret),
                                  lease=lease.id)
        except EtcdError:
            self._orphans.add(lease.id)
            raise
        self.lease = lease
        self._etcd_ok("lease grant")
        node.events("etcd_lease", lease=format(lease.id, "x"), ttl=lease.ttl)
        return lease

    async def _hold(self, lease: Lease) -> str:
        """Stand and lead under ``lease`` until it is lost; returns why it was."""
        keep = asyncio.create_task(self._keepalive(lease))
        try:
            while True:
                won = await self._until_lost(keep, self._campaign(lease))
                if keep.done():
                    return keep.result()
                if won is None:
                    continue
                self._deposed.clear()
                self._lead(*won)
                if self._leading is None:  # the lease may be gone: let the keepalive task find out
                    await self._until_lost(keep, asyncio.sleep(min(1.0, self.ttl_s / 4)))
                else:
                    await self._until_lost(keep, self._deposed.wait())
                if keep.done():
                    return keep.result()
        finally:
            keep.cancel()
            await asyncio.gather(keep, return_exceptions=True)

    @staticmethod
    async def _until_lost(keep: asyncio.Task, coro):
        """Run ``coro`` until it ends or ``keep`` does (then it is cancelled); its result or None."""
        task = asyncio.ensure_future(coro)
        try:
            await asyncio.wait({keep, task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        return None if task.cancelled() else task.result()

    async def _keepalive(self, lease: Lease) -> str:
        """Keep ``lease`` alive every third of its TTL, moving the deadline; returns why it ended."""
        every = lease.ttl / 3
        while True:
            sent = time.monotonic()
            try:
                left = await self.client.keepalive(lease.id, timeout_s=every)
            except EtcdError as exc:
                if time.monotonic() >= self._deadline:
                    return f"etcd unreachable for the lease's TTL ({exc})"
                self._etcd_failed("keepalive", exc)
                await asyncio.sleep(min(every / 2, max(0.05, self._deadline - time.monotonic())))
                continue
            if left <= 0:
                return "the lease expired at etcd"
            self._etcd_ok("keepalive")
            self._deadline = max(self._deadline, sent + left)
            await asyncio.sleep(every)

    async def _campaign(self, lease: Lease) -> tuple[LeaderKey, int] | None:
        """Stand until this node leads: ``(leader key, store revision it was confirmed at)``, or None (etcd
        unreachable: after a pause)."""
        value = self._value()
        try:
            won = await self.client.campaign(self.election_name, lease.id, value)
            kv, at = await self.client.leader(self.election_name)
        except LeaseNotFound:
            await asyncio.sleep(self.ttl_s)  # the keepalive task notices it too and ends the session
            return None
        except EtcdError as exc:
            self._etcd_failed("campaign", exc)
            await asyncio.sleep(min(1.0, self.ttl_s / 4))
            return None
        self._etcd_ok("campaign")
        if kv is None or kv.key != won.key or kv.create_revision != won.rev:
            log.info("node %d: a campaign returned but its key no longer leads; standing again", self.me)
            return None
        return won, at

    def _lead(self, won: LeaderKey, at: int) -> None:
        if time.monotonic() >= self._deadline:
            return  # the lease may be gone already: the keepalive task decides
        self._won_at = at
        if won.rev < self.max_term:
            log.error("node %d: etcd made this node leader at revision %d, below the term %d seen before; its "
                      "plans will be refused until etcd's revision passes it", self.me, won.rev, self.max_term)
        self._leading, self.term, self._reported = won, won.rev, False
        self.controller = self.me
        self.seen_term(won.rev)
        log.info("node %d leads in etcd: term %d (lease %x)", self.me, won.rev, won.lease)
        self.node.heartbeats.elect()

    def _step_down(self, why: str, level: int = logging.WARNING) -> None:
        if self._leading is None:
            return
        term, self._leading = self._leading.rev, None
        if self.controller == self.me:
            self.controller = None
        log.log(level, "node %d steps down as controller (term %d): %s", self.me, term, why)
        self.node.events("step_down", term=term, why=why[:200])
        self._deposed.set()

    # ------------------------------------------------------------------------------------- watching

    async def watch_loop(self) -> None:
        """Supervised: every heartbeat, read the election's leader and the member records (and revoke the leases
        this node lost, while any is left)."""
        node = self.node
        while node.running:
            if self._orphans:
                await self._revoke_orphans()
            try:
                kv, rev = await self.client.leader(self.election_name)
                self._new_cluster_check()
                self._on_leader(kv, rev)
                self._on_members(await self.client.range_prefix(self.members_prefix, limit=membership.MAX_MEMBERS))
                self._etcd_ok("watch")
            except EtcdError as exc:
                self._etcd_failed("watch", exc)
            await asyncio.sleep(node.cfg.heartbeat_s)

    def _new_cluster_check(self) -> None:
        cid = self.client.cluster_id
        if cid is not None and self._cluster_id is not None and cid != self._cluster_id:
            log.warning("node %d: etcd answers as another cluster (%x, was %x): its revisions started again; "
                        "forgetting the terms seen", self.me, cid, self._cluster_id)
            self.max_term = self.term if self._leading is not None else 0
        self._cluster_id = cid

    def _on_leader(self, kv, rev: int) -> None:
        if self._leading is not None and rev < self._won_at:
            return  # an answer from before this node's own win
        if kv is None:
            self._step_down("etcd says nobody leads (this node's candidacy is gone)")
            self.controller = None
            return
        if self._leading is not None and kv.key != self._leading.key:
            self._step_down(f"etcd names another leader (term {kv.create_revision})")
        who = self._parse_value(kv)
        if who is None or kv.create_revision < self.max_term:
            return
        self.seen_term(kv.create_revision)
        if self._leading is None:  # (this node's own key, before its campaign returns: it does not lead yet)
            self.controller = None if who == self.me else who

    def _on_members(self, kvs) -> None:
        found = {}
        for kv in kvs:
            try:
                m = membership.parse_record(kv.value, f"etcd member record {kv.key[-64:]!r}", self.node.secret)
                if kv.key != self._member_key(m.rank):
                    raise ProtocolError("record stored under another rank's key")
                found[m.rank] = m
            except ProtocolError as exc:
                if (kv.key, kv.mod_revision) not in self._bad_records and len(self._bad_records) < 4096:
                    self._bad_records.add((kv.key, kv.mod_revision))
                    log.warning("node %d: ignoring etcd member record: %s", self.me, exc)
        hb = self.node.heartbeats
        hb.membership.registered = set(found) | {self.me}
        hb.merge_members(found)

    # ------------------------------------------------------------------------------------- records

    def _member_key(self, rank: int) -> bytes:
        return self.members_prefix + f"{rank:06d}".encode()

    def _value(self) -> bytes:
        body = {"rank": self.me, "inc": self.node.inc}
        mac = self.node.secret.mac(_VALUE_LABEL, wire.dump_json(body)).hex()
        return wire.dump_json({**body, "mac": mac})

    def _parse_value(self, kv) -> int | None:
        """The rank a leader key names, or None (logged once) if its value is not a candidacy of this cluster."""
        try:
            doc = wire.parse_json(kv.value, "etcd leader value", max_bytes=4096)
            body = {"rank": doc.get("rank"), "inc": doc.get("inc")}
            mac = self.node.secret.mac(_VALUE_LABEL, wire.dump_json(body)).hex()
            if set(doc) != {"rank", "inc", "mac"} or doc["mac"] != mac:
                raise ProtocolError("not signed with this cluster's secret")
            if not isinstance(body["rank"], int) or not 0 <= body["rank"] < 1 << 31 or not isinstance(body["inc"], str):
                raise ProtocolError("fields out of range")
            return body["rank"]
        except ProtocolError as exc:
            if (kv.key, kv.mod_revision) not in self._bad_records and len(self._bad_records) < 4096:
                self._bad_records.add((kv.key, kv.mod_revision))
                log.warning("node %d: etcd's leader key %r is not a candidate of this cluster: %s", self.me,
                            kv.key[-64:], exc)
            return None

    # ------------------------------------------------------------------------------------- failures

    def _etcd_failed(self, call: str, exc: BaseException) -> None:
        self.node.failure("etcd")
        if call in self._failing:
            log.debug("node %d: etcd %s failed again: %s", self.me, call, exc)
            return
        self._failing.add(call)
        log.warning("node %d: etcd %s failed (retrying): %s", self.me, call, exc)
        self.node.events("etcd_error", call=call, why=str(exc)[:200])

    def _etcd_ok(self, call: str) -> None:
        if call in self._failing:
            self._failing.discard(call)
            log.info("node %d: etcd %s works again", self.me, call)
            self.node.events("etcd_ok", call=call)
