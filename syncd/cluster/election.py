"""Choosing the one controller of a cluster.

Rule: the controller is the live node with the lowest rank (liveness from :mod:`syncd.cluster.membership`).
A node only claims the role after it has been up for ``grace_s`` (at least the dead-after period), so a
node that has just started cannot take over before it has had the chance to hear from lower ranks. Every
claim opens a new *term*, one more than the highest term the node has seen in any heartbeat; plans carry
their term, and nodes follow the plan of the highest term, so a deposed controller's late plans are ignored.
Two nodes that claim at once (neither had heard the other yet) can open the same term; the controller that
hears a rival claiming a term at least its own (:meth:`Election.rival_claim`) claims again with a new, higher
term, so the plans of the lowest rank win and no two controllers' plans share a term for long.

When the controller dies, its heartbeats stop; every node drops it from the live set after ``dead_after_s``
and the next-lowest live rank claims the role at its next heartbeat tick: a takeover takes between one and
two dead-after periods (three to six heartbeats by default). The new controller rebuilds what it needs
from shared state, not from its predecessor: the manifests in the store, each node's delivered version and
held shards (from heartbeats) and the last plans, which every node has received (see ``ClusterNode``).

Its terms are not fencing tokens (two nodes can open the same term, and a node that was cut off opens terms of
its own): a plan of any term is taken and the per-version order decides (``ClusterNode``). With etcd
(``--etcd``) the election is :class:`syncd.cluster.etcd_election.EtcdElection` instead, with the same interface.

Pure logic (the caller passes the clock); not thread-safe.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class Election:
    """The state of one node's view of the controller."""

    def __init__(self, me: int, *, grace_s: float, started: float):
        self.me = me
        self.grace_s = grace_s
        self.started = started
        self.max_term = 0
        self.term = 0  # the term this node controls, while it is the controller
        self.controller: int | None = None
        self._rival = False  # a peer claims a term >= ours: claim again at the next evaluation

    def seen_term(self, term: int) -> None:
        """A term announced by a peer (heartbeat or plan)."""
        if isinstance(term, int) and term > self.max_term:
            self.max_term = term

    def rival_claim(self, rank: int, term: int) -> None:
        """Peer ``rank`` says it is the controller and has seen ``term``. If this node controls a term no higher,
        the two terms may be equal (simultaneous claims), so the next :meth:`evaluate` opens a new term."""
        self.seen_term(term)
        if rank != self.me and self.is_controller and isinstance(term, int) and term >= self.term:
            self._rival = True

    def evaluate(self, live: list[int], now: float) -> tuple[int | None, bool]:
        """``(controller, became)``: who controls now as seen here, and whether this node just took over
        (then :attr:`term` is its new term). The controller is None while this node is in its grace period
        and sees no lower live rank."""
        lowest = min(live) if live else None
        if lowest == self.me and now - self.started < self.grace_s:
            lowest = None  # too early to claim: a lower rank may not have been heard yet
        became = lowest == self.me and (self.controller != self.me or self._rival)
        if became:
            again = self.controller == self.me
            self.max_term += 1
            self.term = self.max_term
            log.info("rank %d %s as controller, term %d", self.me,
                     "claims again (a rival claimed the same term)" if again else "takes over", self.term)
        elif lowest != self.me and self.controller == self.me:
            log.info("rank %d steps down as controller (rank %s is live and lower)", self.me, lowest)
        self.controller = lowest
        self._rival = False
        return lowest, became

    @property
    def is_controller(self) -> bool:
        return self.controller == self.me

    def is_stale(self, term) -> bool:
        """Whether a plan or controller heartbeat of ``term`` is refused: never here (see the module docstring)."""
        return False

    def loops(self) -> dict:
        """Long-lived tasks this election needs: none (it runs in the heartbeat loop)."""
        return {}

    async def close(self) -> None:
        """Nothing to release."""
