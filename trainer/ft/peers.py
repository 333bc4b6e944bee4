"""Where every owner's replica server is, the replicator that keeps its holders up to date, and the rebuild of a
lost owner from them (the transport and the server are :mod:`syncd.trainer.ft.replicas`).

* :class:`PeerDirectory` keeps ``{owner: {"url", "node"}}`` in the store (``runs/<run>/trainer/peers/<owner>.json``);
  a restarted owner announces its new address, and a reader treats the entries as hostile (bounded JSON; the data
  it fetches is verified anyway).
* :class:`Replicator` pushes an owner's newest durable checkpoint to its holders on one background thread.
* :func:`rebuild_from_peers` fetches an owner's newest replica that verifies, in memory.

Thread-safety: :class:`Replicator` pushes on one background thread and may be called from any; the rest is
stateless.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from pathlib import Path

from syncd import jsonsafe
from syncd import manifest as mf
from syncd.trainer.ft.ckpt_format import StateError, check_owner
from syncd.trainer.ft.replicas import ReplicaError, fetch_checkpoint, list_replicas, push_replica

log = logging.getLogger(__name__)

__all__ = ["PeerDirectory", "Replicator", "rebuild_from_peers"]


# ---------------------------------------------------------------------------------------------- directory


class PeerDirectory:
    """Where every owner's replica server is: ``runs/<run>/trainer/peers/<owner>.json`` in the store."""

    MAX_BYTES = 4096

    def __init__(self, store, run_id: str):
        from syncd.store import Store

        self.store, self.run_id = Store.open(store), mf.check_run_id(run_id)

    def _key(self, owner: str) -> str:
        return f"{mf.run_prefix(self.run_id)}trainer/peers/{check_owner(owner)}.json"

    def announce(self, owner: str, url: str, node: str) -> None:
        self.store.put(self._key(owner), json.dumps({"owner": owner, "url": url, "node": node,
                                                     "t": time.time()}).encode())

    def lookup(self, owner: str) -> dict | None:
        """``{"url", "node"}`` of ``owner`` or None (not announced, or an entry that is not one)."""
        from syncd.errors import ObjectNotFound

        try:
            raw = self.store.get_bounded(self._key(owner), self.MAX_BYTES)
        except ObjectNotFound:
            return None
        except Exception as exc:  # noqa: BLE001 -- a store hiccup or a huge object: no address
            log.warning("peer directory: %s unreadable: %s", owner, exc)
            return None
        try:
            doc = jsonsafe.loads(raw, what=f"peer entry {owner}", max_bytes=self.MAX_BYTES, max_depth=2)
        except jsonsafe.JSONError as exc:
            log.warning("peer directory: %s", exc)
            return None
        if not isinstance(doc, dict) or doc.get("owner") != owner or not isinstance(doc.get("url"), str):
            log.warning("peer directory: the entry of %s is malformed", owner)
            return None
        return {"url": doc["url"][:300], "node": str(doc.get("node"))[:200]}


# ---------------------------------------------------------------------------------------------- replicator


class Replicator:
    """Pushes ``owner``'s newest durable checkpoint to its holders (``holders``: owner names, looked up in
    ``directory``) on one background thread; a newer checkpoint replaces a queued older one. ``acked(step)``:
    the holders that took ``step``; :meth:`wait_replicated` is what publishing waits on. Failures are logged and
    counted (``failures``), never raised into training."""

    def __init__(self, owner: str, holders: list[str], directory: PeerDirectory, *, timeout_s: float = 120.0):
        self.owner, self.holders, self.directory, self.timeout_s = owner, list(holders), directory, timeout_s
        self.failures = 0
        self.last_error: str | None = None
        self._acks: dict[int, set] = {}
        self._tried: dict[int, set] = {}
        self._queue: queue.Queue = queue.Queue()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._work, name=f"replicator-{owner}", daemon=True)
        self._thread.start()

    def __call__(self, step: int, path) -> None:
        """The checkpointer's listener: replicate ``path`` (step ``step``)."""
        self._queue.put((step, Path(path)))

    def acked(self, step: int) -> set:
        with self._cond:
            return set().union(*(a for s, a in self._acks.items() if s >= step))

    def wait_replicated(self, step: int, timeout: float | None = None) -> set:
        """Wait until a checkpoint of ``step`` or later was offered to every holder (taken or not); the holders
        that took it. Returns early with what there is after ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                tried = set().union(*(t for s, t in self._tried.items() if s >= step))
                if tried >= set(self.holders):
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._cond.wait(0.2 if left is None else min(left, 0.2))
        return self.acked(step)

    def close(self, timeout: float = 30.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            while job is not None and not self._queue.empty():  # only the newest matters
                nxt = self._queue.get()
                job = job if nxt is None else nxt
                if nxt is None:
                    self._queue.put(None)
                    break
            if job is None:
                return
            step, path = job
            for holder in self.holders:
                ok = False
                try:
                    where = self.directory.lookup(holder)
                    if where is None:
                        raise ReplicaError(f"{holder} has not announced a replica server")
                    push_replica(where["url"], path, owner=self.owner, step=step, timeout_s=self.timeout_s)
                    ok = True
                except (ReplicaError, OSError) as exc:
                    self.failures += 1
                    self.last_error = str(exc)
                    log.warning("%s: step %d not replicated to %s: %s", self.owner, step, holder, exc)
                with self._cond:
                    self._tried.setdefault(step, set()).add(holder)
                    if ok:
                        self._acks.setdefault(step, set()).add(holder)
                    for old in [s for s in self._tried if s < step - 8]:
                        self._tried.pop(old, None)
                        self._acks.pop(old, None)
                    self._cond.notify_all()


def rebuild_from_peers(owner: str, holders: list[str], directory: PeerDirectory, *, signing_key=None,
                       at_most: int | None = None):
    """``owner``'s newest verifiable replica from its holders, fetched and parsed in memory (:func:`fetch_checkpoint`):
    ``(bundle, checkpoint, holder)``, or None when no holder has one that verifies (each corrupt or unreachable one
    is logged and the next tried). The caller persists the bundle (:func:`write_bundle`), off the critical path."""
    offers = []
    for holder in holders:
        where = directory.lookup(holder)
        if where is None:
            log.warning("%s: holder %s has no announced replica server", owner, holder)
            continue
        try:
            offers += [(s, holder, where["url"]) for s in list_replicas(where["url"], owner)
                       if at_most is None or s <= at_most]
        except ReplicaError as exc:
            log.warning("%s: cannot list the replicas %s holds: %s", owner, holder, exc)
    for step, holder, url in sorted(offers, key=lambda o: -o[0]):  # newest first; holders in placement order
        try:
            bundle, c = fetch_checkpoint(url, owner, step, signing_key=signing_key)
            log.warning("%s: rebuilt step %d from the replica held by %s", owner, step, holder)
            c.source = holder
            return bundle, c, holder
        except (StateError, ReplicaError) as exc:
            log.warning("%s: replica of step %d held by %s skipped: %s", owner, step, holder, exc)
    return None
