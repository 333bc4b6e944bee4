"""Where every owner's replica server is, the replicator that keeps its holders up to date, and the rebuild of a
lost owner from them (the transport and the server are :mod:`syncd.trainer.ft.replicas`).

* :class:`PeerDirectory` keeps ``{owner: {"url", "node"}}`` in the store (``runs/<run>/trainer/peers/<owner>.json``);
  a restarted owner announces its new address, and a reader treats the entries as hostile (bounded JSON; the data
  it fetches is verified anyway). It also keeps **what each owner recorded** of its checkpoints
  (``runs/<run>/trainer/checkpoints/<owner>.json``: the SHA-256 of each replicated step's manifest, the newest
  :data:`RECORDED_STEPS`): a replica is trusted only if its manifest is the one its owner recorded, so a replica
  pushed by anyone else -- or corrupted, or of another run -- is never loaded, signing key or not.
* :class:`Replicator` records each durable checkpoint, then pushes it to its holders (with the job's token) on one
  background thread.
* :func:`rebuild_from_peers` fetches an owner's newest replica that verifies against its record, in memory.

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
from syncd.trainer.ft.ckpt_format import MANIFEST, StateError, check_owner, manifest_digest
from syncd.trainer.ft.replicas import ReplicaError, fetch_checkpoint, held_manifests, list_replicas, push_replica

log = logging.getLogger(__name__)

__all__ = ["PeerDirectory", "Replicator", "rebuild_from_peers", "RECORDED_STEPS"]

#: how many of an owner's newest replicated steps its record keeps
RECORDED_STEPS = 64


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

    def _record_key(self, owner: str) -> str:
        return f"{mf.run_prefix(self.run_id)}trainer/checkpoints/{check_owner(owner)}.json"

    def record(self, owner: str, steps: dict[int, str]) -> None:
        """Store ``owner``'s record: step -> the SHA-256 of that checkpoint's manifest (its newest
        :data:`RECORDED_STEPS`). Raises what the store raises."""
        newest = dict(sorted(steps.items())[-RECORDED_STEPS:])
        self.store.put(self._record_key(owner), json.dumps(
            {"owner": owner, "run_id": self.run_id, "steps": {str(s): h for s, h in newest.items()}}).encode())

    def recorded(self, owner: str) -> dict[int, str] | None:
        """``owner``'s record (step -> manifest SHA-256); ``{}`` when it recorded nothing, None when the store
        cannot say (unreadable, or not a record: logged)."""
        from syncd.errors import ObjectNotFound

        what = f"the checkpoint record of {owner}"
        try:
            raw = self.store.get_bounded(self._record_key(owner), 64 * RECORDED_STEPS + 4096)
            doc = jsonsafe.loads(raw, what=what, max_bytes=64 * RECORDED_STEPS + 4096, max_depth=3, floats=False)
        except ObjectNotFound:
            return {}
        except Exception as exc:  # noqa: BLE001 -- a store hiccup, an oversized or malformed object
            log.warning("peer directory: %s unreadable: %s", what, exc)
            return None
        steps = doc.get("steps") if isinstance(doc, dict) else None
        if doc.get("owner") != owner or doc.get("run_id") != self.run_id or not isinstance(steps, dict) or not all(
                k.isdigit() and isinstance(v, str) and len(v) == 64 for k, v in steps.items()):
            log.warning("peer directory: %s is malformed", what)
            return None
        return {int(k): v for k, v in steps.items()}

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
    """Records ``owner``'s newest durable checkpoint in ``directory`` and pushes it to its holders (``holders``:
    owner names, looked up in ``directory``; ``token``: the job's replica token) on one background thread; a newer
    checkpoint replaces a queued older one. ``acked(step)``: the holders that took ``step``;
    :meth:`wait_replicated` is what publishing waits on, :meth:`drain` what a clean shutdown waits on. Failures are
    logged and counted (``failures``), never raised into training; a checkpoint that could not be recorded is not
    pushed (no holder could be trusted with it)."""

    def __init__(self, owner: str, holders: list[str], directory: PeerDirectory, *, timeout_s: float = 120.0,
                 token: str | None = None):
        self.owner, self.holders, self.directory, self.timeout_s = owner, list(holders), directory, timeout_s
        self.token = token
        self.failures = 0
        self.last_error: str | None = None
        self._records: dict[int, str] | None = None  # what this owner recorded (read from the store once)
        self._handed = self._done = 0  # checkpoints handed over / dealt with (replicated or replaced by newer)
        self._acks: dict[int, set] = {}
        self._tried: dict[int, set] = {}
        self._queue: queue.Queue = queue.Queue()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._work, name=f"replicator-{owner}", daemon=True)
        self._thread.start()

    def __call__(self, step: int, path, *, again: bool = False) -> None:
        """The checkpointer's listener: replicate ``path`` (step ``step``). ``again``: a checkpoint offered once
        more (a restore's): a holder whose listing shows exactly its manifest counts as having taken it, unsent."""
        with self._cond:
            self._handed += 1
            self._queue.put((self._handed, step, Path(path), again))

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

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every checkpoint handed over was offered to every holder; False after ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._done < self._handed:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(0.05 if left is None else min(left, 0.05))
        return True

    def close(self, timeout: float = 30.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            while job is not None and not self._queue.empty():  # only the newest matters
                nxt = self._queue.get()
                if nxt is None:
                    self._queue.put(None)
                    break
                job = nxt
            if job is None:
                return
            seq, step, path, again = job
            try:
                self._replicate(step, path, again)
            except Exception:  # noqa: BLE001 -- the replicator outlives any one checkpoint
                self.failures += 1
                log.exception("%s: replicating step %d failed", self.owner, step)
            finally:
                with self._cond:
                    self._done = max(self._done, seq)
                    self._cond.notify_all()

    def _record(self, step: int, path: Path) -> str | None:
        """Add ``step``'s manifest digest to this owner's record in the store; the digest, or None (logged,
        counted) if it was not recorded."""
        try:
            digest = manifest_digest((path / MANIFEST).read_bytes())
            if self._records is None:
                self._records = self.directory.recorded(self.owner)
                if self._records is None:
                    raise OSError("the earlier record is unreadable")
            self._records[step] = digest
            self.directory.record(self.owner, self._records)
            return digest
        except Exception as exc:  # noqa: BLE001 -- the store or the disk failed: this step is not replicated
            self.failures += 1
            self.last_error = f"step {step} not recorded: {exc}"
            log.warning("%s: step %d not recorded in the store, so not replicated: %s", self.owner, step, exc)
            return None

    def _replicate(self, step: int, path: Path, again: bool = False) -> None:
        digest = self._record(step, path)
        for holder in self.holders:
            ok = False
            if digest is not None:
                try:
                    where = self.directory.lookup(holder)
                    if where is None:
                        raise ReplicaError(f"{holder} has not announced a replica server")
                    if again and self._holds(where["url"], step) == digest:
                        log.info("%s: %s still holds step %d as recorded; not sent again", self.owner, holder, step)
                    else:
                        push_replica(where["url"], path, owner=self.owner, step=step, token=self.token,
                                     timeout_s=self.timeout_s)
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

    def _holds(self, url: str, step: int) -> str | None:
        """The manifest digest of ``step`` that the holder at ``url`` lists (None: not held, or it cannot say)."""
        try:
            return held_manifests(url, self.owner, token=self.token).get(step)
        except ReplicaError as exc:
            log.info("%s: %s cannot list its replicas (%s): sending step %d", self.owner, url, exc, step)
            return None


def rebuild_from_peers(owner: str, holders: list[str], directory: PeerDirectory, *, signing_key=None,
                       at_most: int | None = None, step: int | None = None, token: str | None = None,
                       run_id: str | None = None):
    """``owner``'s newest replica (``at_most``: no later step; ``step``: that step only) from its holders that is
    the one its owner recorded (:meth:`PeerDirectory.recorded`) and verifies, fetched and parsed in memory
    (:func:`fetch_checkpoint`, presenting ``token``; ``run_id``: of that run): ``(bundle, checkpoint, holder)``, or
    None when no holder has one (each unrecorded, corrupt, foreign or unreachable one is logged with the reason and
    the next tried). The caller persists the bundle (:func:`syncd.trainer.ft.ckpt_dir.write_bundle`), off the
    critical path."""
    offers = []
    for holder in holders:
        where = directory.lookup(holder)
        if where is None:
            log.warning("%s: holder %s has no announced replica server", owner, holder)
            continue
        try:
            offers += [(s, holder, where["url"]) for s in list_replicas(where["url"], owner, token=token)
                       if (at_most is None or s <= at_most) and (step is None or s == step)]
        except ReplicaError as exc:
            log.warning("%s: cannot list the replicas %s holds: %s", owner, holder, exc)
    records = directory.recorded(owner) if offers else {}
    if offers and not records:
        log.warning("%s: no record of its checkpoints in the store (%s): no replica can be trusted", owner,
                    "unreadable" if records is None else "nothing recorded")
        return None
    for s, holder, url in sorted(offers, key=lambda o: -o[0]):  # newest first; holders in placement order
        if s not in records:
            log.warning("%s: replica of step %d held by %s skipped: its owner recorded no checkpoint of that step",
                        owner, s, holder)
            continue
        try:
            bundle, c = fetch_checkpoint(url, owner, s, signing_key=signing_key, token=token, run_id=run_id,
                                         manifest_sha256=records[s])
            log.warning("%s: rebuilt step %d from the replica held by %s", owner, s, holder)
            c.source = holder
            return bundle, c, holder
        except (StateError, ReplicaError) as exc:
            log.warning("%s: replica of step %d held by %s skipped: %s", owner, s, holder, exc)
    return None
