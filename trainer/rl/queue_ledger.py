"""The rollout service's prompt ledger, kept in the run's queue (:mod:`syncd.trainer.rl.group_queue`): which prompt
goes out next, what failed, where a finished group goes -- every decision durable in the store before it takes
effect, so that a restarted service (:mod:`syncd.trainer.rl.rollout_service`) rebuilds it from the store alone.
:class:`QueueSink` is what the rollout workers (:class:`syncd.trainer.rl.rollout_workers.RolloutWorkers`) are given as
their buffer.
"""

from __future__ import annotations

import logging
import threading
from collections import deque

from syncd.errors import ObjectExists, ObjectNotFound, StoreError
from syncd.trainer.rl.group_queue import MAX_ATTEMPT, GroupQueue, QueueError, check_service

log = logging.getLogger(__name__)

__all__ = ["QueueSink"]


class QueueSink:
    """The rollout workers' side of the queue (what :class:`RolloutWorkers` calls its buffer): which prompt comes
    next, what failed, where a finished group goes -- every decision durable in the store before it takes effect
    (the module docstring). ``share``: ``(k, n)``; ``close_open(claim)``: finishes an orphaned attempt's open
    trajectories. Thread-safety: every method from any thread."""

    def __init__(self, queue: GroupQueue, service: str, *, share: tuple[int, int] = (0, 1), stop: threading.Event,
                 backoff_max_s: float = 5.0):
        self.q, self.service, (self.k, self.n), self._stop = queue, check_service(service), share, stop
        self.backoff_max_s = backoff_max_s
        self._lock = threading.Lock()
        self._append = threading.Lock()  # groups are numbered in the order they are written: no gap survives
        self._regen: deque[tuple[int, int]] = deque()
        self._latest: dict[int, int] = {}  # prompt -> its newest claimed attempt
        self._inflight: dict[int, int] = {}
        self._seen_failed: set[tuple[int, int]] = set()
        self.cursor, self.next_seq = self.k, 0
        self.counts = {"claimed": 0, "landed": 0, "failed": 0, "orphaned": 0, "returned": 0, "abandoned": 0}
        self.closed = False

    def mine(self, index: int) -> bool:
        return index % self.n == self.k

    def recover(self, close_open) -> dict:
        """Rebuild the ledger from the store (module docstring); returns what it found."""
        st = self.q.state(self.service, accept=self.mine)
        for (i, a) in st.claims:
            self._latest[i] = max(a, self._latest.get(i, -1))
        orphans = []
        for i, a in sorted(self._latest.items()):
            if (i, a) in st.failed:
                self._again(i, a)
            elif (i, a) not in st.landed:
                orphans.append((i, a))
        for i, a in orphans:
            self.q.fail(i, a, "orphaned: the rollout service restarted while it was in flight", by="service")
            try:
                close_open(self.q.read_claim(i, a))
            except (QueueError, ObjectNotFound) as exc:  # its trajectories cannot be closed; the prompt still goes out
                log.warning("orphaned attempt %d of prompt %d: %s", a, i, exc)
            self._again(i, a)
        self._seen_failed = set(st.failed) | set(orphans)
        top = max(self._latest, default=-1)
        self.cursor = top + 1 + (self.k - (top + 1)) % self.n
        self.next_seq = st.next_seq
        self.counts["orphaned"] = len(orphans)
        found = {"claims": len(st.claims), "landed": len(st.landed), "failed": len(st.failed),
                 "orphaned": len(orphans), "regenerate": len(self._regen), "cursor": self.cursor,
                 "next_seq": self.next_seq, "skipped": len(st.skipped)}
        for key, why in st.skipped.items():
            log.warning("rollout queue: skipped %s: %s", key, why)
        return found

    def _again(self, index: int, attempt: int) -> None:
        if attempt >= MAX_ATTEMPT:
            self.counts["abandoned"] += 1
            log.error("prompt %d failed %d attempts: abandoned", index, attempt + 1)
            return
        self._regen.append((index, attempt + 1))

    def poll_returned(self) -> int:
        """Prompts the trainer sent back since the last poll, queued to be sent again; returns how many."""
        st_failed = {}
        for info in self.q.store.list(self.q.prefix + "failed/"):
            name = info.key.rsplit("/", 1)[-1]
            try:
                i, a = int(name[:10]), int(name[11:14])
            except ValueError:
                continue
            st_failed[(i, a)] = info.key
        n = 0
        with self._lock:
            for (i, a) in sorted(st_failed):
                if (i, a) in self._seen_failed or not self.mine(i):
                    continue
                self._seen_failed.add((i, a))
                if self._latest.get(i) == a and i not in self._inflight:
                    self._again(i, a)
                    self.counts["returned"] += 1
                    n += 1
        return n

    # ------------------------------------------------------------------------------------ RolloutWorkers' calls

    def next_prompt(self, entry_of=None, accept=None) -> tuple[int, int] | None:
        """The next ``(index, attempt)``, claimed in the store; blocks through store failures (retried with
        backoff); None once the service stops."""
        backoff = 0.2
        while True:
            if self._stop.is_set() or self.closed:
                return None
            with self._lock:
                if self._regen:
                    i, a = self._regen.popleft()
                else:
                    i, a = self.cursor, 0
                    self.cursor += self.n
            entry = entry_of(i, a) if entry_of is not None else {}
            try:
                self.q.claim(i, a, {**entry, "service": self.service})
            except ObjectExists:  # sent before, by another life or another copy of this service: never again
                log.error("attempt %d of prompt %d was claimed before; it is sent as the next attempt", a, i)
                self.q.fail(i, a, "claimed twice", by="service")
                with self._lock:
                    self._latest[i] = max(a, self._latest.get(i, -1))
                    self._again(i, a)
                continue
            except StoreError as exc:
                log.warning("claiming attempt %d of prompt %d: %s (retried)", a, i, exc)
                with self._lock:
                    self._regen.appendleft((i, a))
                self._stop.wait(backoff)
                backoff = min(self.backoff_max_s, backoff * 2)
                continue
            with self._lock:
                self._latest[i] = a
                self._inflight[i] = a
                self.counts["claimed"] += 1
            return i, a

    def record_written(self, index: int, sandbox: str) -> None:
        """(The workers report the first record of a group; the queue needs nothing from it.)"""

    def failed(self, index: int) -> None:
        """The in-flight group of ``index`` failed: marked so, its prompt sent again."""
        with self._lock:
            a = self._inflight.pop(index, None)
            if a is None:
                return
            self._seen_failed.add((index, a))
            self.counts["failed"] += 1
        try:
            self.q.fail(index, a, "the group failed in the rollout service", by="service")
        except StoreError as exc:  # a restart would find it orphaned and mark it then
            log.warning("marking attempt %d of prompt %d failed: %s", a, index, exc)
        with self._lock:
            self._again(index, a)

    def put(self, group) -> bool:
        """Append the finished group to the queue as this service's next one (retried through store failures
        until written or the service stops: a number once given is never left empty), with the service's
        ``frontier``: the lowest prompt of its share not landed (what the trainer's buffer policy measures its
        target mix below, ``syncd.trainer.rl.buffer_policy``)."""
        with self._lock:  # every prompt of this share below it has landed (this one does now)
            frontier = min([self.cursor, *(i for i, _ in self._regen),
                            *(i for i in self._inflight if i != group.item.index)])
        doc = {**group.plan(), "token_versions": group.token_versions, "attempt": group.attempt,
               "frontier": frontier}
        backoff = 0.2
        with self._append:
            while True:
                try:
                    self.q.append(self.service, self.next_seq, doc)
                    break
                except ObjectExists:
                    log.error("group number %d of service %s was written by another writer: is a second copy of "
                              "this service running? Stopping.", self.next_seq, self.service)
                    self.close()
                    return False
                except StoreError as exc:
                    if self._stop.is_set():
                        return False
                    log.warning("writing group %d of prompt %d: %s (retried)", self.next_seq, group.item.index, exc)
                    self._stop.wait(backoff)
                    backoff = min(self.backoff_max_s, backoff * 2)
            self.next_seq += 1
        with self._lock:
            self._inflight.pop(group.item.index, None)
            self.counts["landed"] += 1
        return True

    def close(self) -> None:
        self.closed = True

    def stats(self) -> dict:
        with self._lock:
            return {**self.counts, "cursor": self.cursor, "next_seq": self.next_seq, "inflight": len(self._inflight),
                    "regenerate": len(self._regen)}
