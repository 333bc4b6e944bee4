"""The trainer's side of the rollout queue (:mod:`syncd.trainer.rl.group_queue`): every service's groups, read in
order into the trainer's :class:`~syncd.trainer.rl.buffer.RolloutBuffer`, and what the trainer does not train sent
back to be generated again.

    feed = QueueFeed(GroupQueue(store, run_id), buffer, rebuild, positions=restored.get("queue"))
    buffer = RolloutBuffer(eta, on_drop=feed.send_back_groups, frontier=feed.frontier)
    feed.start()

A thread polls the queue every ``poll_interval_s``: for each service (found by listing), the groups from its
position on. A group is **skipped** when its attempt was sent back before (its ``failed/`` object exists: a restart
from a checkpoint older than the return never trains a prompt that is being generated again) or its prompt is
consumed (trained in a committed step). Otherwise ``rebuild(doc)`` reads it back from its records (the trainer
trusts a group only after that) and the buffer takes it; a group that cannot be rebuilt, a malformed object, and a
group the buffer drops or refuses are **sent back** (``failed/<index>-<attempt>``, ``by: "trainer"``), so the
service generates the prompt again: none is lost; a group whose prompt is already buffered (read again after a
restart) is skipped. After each poll the trainer's position is written (``consumer.json``: ``read``, and ``held``,
how many of each service's groups wait in the buffer, with ``step()`` and ``version()``): a service keeps its
unread, held and in-flight groups within its backlog, so a group taken by a step frees a place, as the trainer's
credit did.

:meth:`positions` is the part of the trainer's checkpoint that says where to read on after a restart (taken between
two steps, with the buffer's snapshot); a restored feed reads the groups after it again, and the buffer's ledger
says which were trained. :meth:`frontier` is the lowest prompt index not yet landed over every service (from the
newest group of each), for the buffer policy's target mix.

Failures (the store, a service's malformed object) are logged, counted in :meth:`stats` and retried at the next
poll; the thread never dies of one. The position doc is also the trainer's heartbeat (written every poll, with
``lookahead``: the groups the trainer wants generated ahead, which a service keeps to while the heartbeat is fresh,
growing to its own ``--max-backlog`` only while the trainer is away). ``auto_publish=False`` moves the ``read``
position it shows only when :meth:`publish_position` is called (a synchronous step lets the services generate the
next step's groups once the engines serve its version). Thread-safety: every method from any thread;
``send_back_groups`` only queues (it is called under the buffer's lock) and the thread writes.
"""

from __future__ import annotations

import logging
import threading
from collections import deque

from syncd.errors import StoreError
from syncd.supervise import Failures
from syncd.trainer.rl.group_queue import GroupQueue, QueueError

log = logging.getLogger(__name__)

__all__ = ["QueueFeed"]

ERROR_KINDS = ("store", "malformed", "rebuild", "returned_write")


class QueueFeed:
    """See the module docstring. ``rebuild(doc) -> Group`` raises when the group cannot be read back;
    ``positions``: ``{service: next seq}`` of a restored checkpoint."""

    def __init__(self, queue: GroupQueue, buffer, rebuild, *, positions: dict | None = None, step=lambda: 0,
                 version=lambda: 0, poll_interval_s: float = 0.2, auto_publish: bool = True,
                 lookahead: int | None = None):
        self.q, self.buffer, self.rebuild = queue, buffer, rebuild
        self.step, self.version, self.poll_interval_s = step, version, poll_interval_s
        self._lock = threading.Lock()
        self._pos: dict[str, int] = {str(k): int(v) for k, v in (positions or {}).items()}
        self._frontiers: dict[str, int] = {}
        self._back: deque[tuple[int, int, str]] = deque()
        self.auto_publish, self.lookahead = auto_publish, lookahead
        self._shown: dict[str, int] = dict(self._pos)  # the read position the services see
        self._owner: dict[int, str] = {}  # prompt -> the service its buffered group came from
        self.errors = Failures(ERROR_KINDS)
        self.counts = {"read": 0, "buffered": 0, "skipped_returned": 0, "skipped_held": 0, "sent_back": 0}
        self._stop = threading.Event()
        self._wake = threading.Event()  # something to send back: the thread writes it now, not at the next poll
        self._thread = threading.Thread(target=self._run, name="queue-feed", daemon=True)

    # ------------------------------------------------------------------------------------ control

    def start(self) -> "QueueFeed":
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self._flush_back()  # what was dropped at the end still goes back

    def publish_position(self, *, move: bool = True) -> None:
        """Write the trainer's position now (``read``, ``held``, ``lookahead``, step, version; with ``move=False``
        the ``read`` shown before: a heartbeat); StoreError when it cannot."""
        held: dict[str, int] = {}
        indices = self.buffer.indices()
        with self._lock:
            for i in indices:
                s = self._owner.get(i)
                if s is not None:
                    held[s] = held.get(s, 0) + 1
            if len(self._owner) > 4 * len(indices) + 1024:  # trained prompts' entries, kept no longer
                keep = set(indices)
                self._owner = {i: s for i, s in self._owner.items() if i in keep}
            if move:
                self._shown = dict(self._pos)
            read = dict(self._shown)
        extra = {} if self.lookahead is None else {"lookahead": int(self.lookahead)}
        self.q.set_consumer(read, held=held, step=int(self.step()), version=int(self.version()), **extra)

    def positions(self) -> dict:
        with self._lock:
            return dict(self._pos)

    def frontier(self) -> int:
        """The lowest prompt not yet landed, over the services read so far (0 before any group)."""
        with self._lock:
            return min(self._frontiers.values()) if self._frontiers else 0

    def stats(self) -> dict:
        with self._lock:
            return {**self.counts, "positions": dict(self._pos), "errors": self.errors.totals,
                    "to_send_back": len(self._back)}

    def send_back_groups(self, groups) -> None:
        """The buffer dropped or refused ``groups``: queued to be sent back (``RolloutBuffer(on_drop=)``)."""
        with self._lock:
            for g in groups:
                self._back.append((g.item.index, g.attempt, "dropped or refused by the trainer's buffer"))
        self._wake.set()

    def send_back(self, index: int, attempt: int, reason: str) -> None:
        """Send attempt ``attempt`` of prompt ``index`` back now (e.g. dropped when a checkpoint was restored)."""
        self._back_now(index, attempt, reason)

    # ------------------------------------------------------------------------------------ the thread

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll()
            except Exception:  # noqa: BLE001 -- the feed must outlive anything: counted, logged, retried
                self.errors("store")
                log.exception("rollout queue feed")
            self._wake.wait(self.poll_interval_s)
            self._wake.clear()

    def poll(self) -> int:
        """One pass over every service; returns how many groups the buffer took."""
        self._flush_back()
        taken = 0
        try:
            services = self.q.services()
        except StoreError as exc:
            self.errors("store")
            log.warning("listing the rollout services: %s", exc)
            return 0
        for service in services:
            with self._lock:
                start = self._pos.get(service, 0)
            try:
                items, nxt = self.q.read_groups(service, start)
            except StoreError as exc:
                self.errors("store")
                log.warning("reading the groups of %s: %s", service, exc)
                continue
            for item in items:
                taken += self._take(service, item)
            with self._lock:
                self._pos[service] = nxt
        try:
            self.publish_position(move=self.auto_publish)
        except StoreError as exc:
            self.errors("store")
            log.warning("writing the trainer's position: %s", exc)
        return taken

    def _take(self, service: str, item) -> int:
        if isinstance(item, QueueError):
            self.errors("malformed")
            log.warning("rollout queue: %s", item)
            got = GroupQueue.attempt_of(item)
            if got is not None:
                self._back_now(*got, f"malformed: {item}")
            return 0
        index, attempt = int(item["item"]["index"]), int(item["attempt"])
        with self._lock:
            self.counts["read"] += 1
            if isinstance(item.get("frontier"), int) and not isinstance(item["frontier"], bool):
                self._frontiers[service] = max(self._frontiers.get(service, 0), item["frontier"])
        if self.buffer.holds(index):
            self.counts["skipped_held"] += 1
            return 0
        if self.q.store.exists(self.q.failed_key(index, attempt)):
            self.counts["skipped_returned"] += 1
            return 0
        try:
            group = self.rebuild(item)
        except Exception as exc:  # noqa: BLE001 -- whatever the records hold, the prompt is generated again
            self.errors("rebuild")
            log.warning("group of prompt %d (attempt %d) not read back: %s: %s", index, attempt,
                        type(exc).__name__, exc)
            self._back_now(index, attempt, f"not read back: {type(exc).__name__}: {exc}")
            return 0
        group.attempt = attempt
        with self._lock:
            self._owner[index] = service
        if self.buffer.put(group):  # a refusal was queued to go back by on_drop
            self.counts["buffered"] += 1
            return 1
        return 0

    def _back_now(self, index: int, attempt: int, reason: str) -> None:
        with self._lock:
            self._back.append((index, attempt, reason))
        self._flush_back()

    def _flush_back(self) -> None:
        while True:
            with self._lock:
                if not self._back:
                    return
                index, attempt, reason = self._back[0]
            try:
                self.q.fail(index, attempt, reason, by="trainer")
            except StoreError as exc:
                self.errors("returned_write")
                log.warning("sending prompt %d (attempt %d) back: %s (retried)", index, attempt, exc)
                return
            with self._lock:
                self._back.popleft()
                self.counts["sent_back"] += 1
