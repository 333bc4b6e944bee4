"""Which replica group of an elastic job runs the live side (publishing, the queue feed, the buffer, the plans),
and when another group takes it over. No group is special: the first to claim a term leads it.

    runs/<run>/trainer/leaders/<term, 12 digits>.json   {"term": T, "group": G, "life": "<hex>"}   create-only
    runs/<run>/trainer/leader-beat.json                 {"term": T, "group": G, "life": ..., "beat": n}

* **Terms.** A term is claimed by creating its object (create-only, as the rollout queue's claims): of any number
  of groups claiming term ``T`` at once, exactly one succeeds; the others stay followers. The leader of the newest
  term runs the live side; a fresh job's group 0 claims term 1 at once, any other claim waits until the current
  leader is gone.
* **Gone** (:meth:`Leadership.leader_gone`): the newest term's heartbeat object has not changed for ``timeout_s``
  as this follower saw it (its own monotonic clock: no clock is compared across machines), or no term was claimed
  within ``timeout_s`` of this follower's start, or the newest term is this group's own previous life (a restarted
  leader knows it is dead). The leader rewrites the heartbeat every ``beat_s`` on its own thread.
* **Deposed**: a leader that finds a newer term claimed (its heartbeat thread looks each beat) stops leading:
  :meth:`Leadership.check` raises :class:`Deposed` (the group exits and is restarted as a follower). Plans are
  create-only, so even before it notices it cannot log a second plan for a step, and :meth:`Leadership.fence`
  looks again right before each of its versions becomes visible (the publisher's commit gate): what is left is the
  moment between that look and the manifest's write.

What a new leader starts from is the live side's newest logged RL state (:class:`syncd.trainer.ft.plan_log.LiveStateLog`)
and the plans logged after it (:class:`syncd.trainer.rl.plans.LoggedPlans`).

Every object read is hostile: a claim is bounded, strict JSON with typed members (one that is not is no claim:
logged and counted); the heartbeat is only compared byte for byte with the last one seen. Thread-safety:
:meth:`claim`, :meth:`leader_gone` and :meth:`check` from the training thread, :meth:`fence` from the publisher's;
the heartbeat thread only writes the heartbeat and sets the deposed flag.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid

from syncd import jsonsafe
from syncd import manifest as mf
from syncd.errors import ObjectExists, ObjectNotFound, StoreError, SyncdError
from syncd.store import Store

log = logging.getLogger(__name__)

__all__ = ["Leadership", "Deposed"]

MAX_DOC_BYTES = 4096


class Deposed(RuntimeError):
    """A newer term was claimed: this group no longer leads (it exits and is restarted as a follower)."""


class Leadership:
    """Replica group ``group``'s view of the terms (module docstring). ``timeout_s``: how long a silent leader is
    waited for; ``beat_s``: the leader's heartbeat period (well under ``timeout_s``)."""

    def __init__(self, store, run_id: str, group: int, *, timeout_s: float = 10.0, beat_s: float = 1.0):
        if not 0 < beat_s < timeout_s:
            raise ValueError(f"the heartbeat period ({beat_s} s) must be positive and under the timeout ({timeout_s} s)")
        self.store, self.run_id, self.group = Store.open(store), mf.check_run_id(run_id), int(group)
        self.timeout_s, self.beat_s = float(timeout_s), float(beat_s)
        self.life = uuid.uuid4().hex
        self.term: int | None = None  # the term this group leads (None: a follower)
        self.counts = {"claims": 0, "claims_lost": 0, "beat_errors": 0, "bad_objects": 0}
        self._started = time.monotonic()
        self._watched: tuple[int | None, str | None, float] = (None, None, self._started)  # term, beat, since
        self._deposed = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _prefix(self) -> str:
        return f"{mf.run_prefix(self.run_id)}trainer/leaders/"

    def _beat_key(self) -> str:
        return f"{mf.run_prefix(self.run_id)}trainer/leader-beat.json"

    def newest(self) -> tuple[int, dict] | None:
        """``(term, {"term", "group", "life"})`` of the newest claimed term; None when none is. StoreError when
        the store cannot be listed."""
        terms = []
        for info in self.store.list(self._prefix()):
            name = info.key.rsplit("/", 1)[-1]
            if len(name) == 17 and name.endswith(".json") and name[:12].isdigit():
                terms.append(int(name[:12]))
        for term in sorted(terms, reverse=True):
            doc = self._read(f"{self._prefix()}{term:012d}.json")
            if isinstance(doc, dict) and doc.get("term") == term and isinstance(doc.get("group"), int) \
                    and not isinstance(doc["group"], bool) and isinstance(doc.get("life"), str):
                return term, doc
            if doc is not None:
                self.counts["bad_objects"] += 1
                log.warning("leadership: %s is not a term claim; ignored", f"{self._prefix()}{term:012d}.json")
        return None

    def _read(self, key: str):
        try:
            raw = self.store.get_bounded(key, MAX_DOC_BYTES)
            return jsonsafe.loads(raw, what=key, max_bytes=MAX_DOC_BYTES, max_depth=4)
        except ObjectNotFound:
            return None
        except (SyncdError, ValueError) as exc:
            log.warning("leadership: %s", exc)
            return {}  # counted by the caller as not a claim

    # ---------------------------------------------------------------------------------------- followers

    def may_claim_at_start(self) -> bool:
        """A fresh job's group 0 claims (term 1) at once: no term exists yet."""
        return self.group == 0 and self.newest() is None and self._watched[0] is None

    def leader_gone(self) -> bool:
        """Whether the newest term's leader is gone (module docstring); each call is one look at the store."""
        cur = self.newest()
        now = time.monotonic()
        if cur is None:
            return now - self._started > self.timeout_s
        term, doc = cur
        if doc["group"] == self.group and doc["life"] != self.life:
            self._watched = (term, None, now)
            return True  # this group's own earlier life led it
        try:
            beat = self.store.get_bounded(self._beat_key(), MAX_DOC_BYTES).decode("utf-8", "replace")
        except ObjectNotFound:
            beat = None
        seen_term, seen_beat, since = self._watched
        if term != seen_term or beat != seen_beat:
            self._watched = (term, beat, now)
            return False
        return now - since > self.timeout_s

    def claim(self) -> bool:
        """Claim the term after the newest one this group has seen (by :meth:`leader_gone`; none: term 1): True if
        this group now leads it (the heartbeat starts), False if another group claimed it first. StoreError when
        the store fails."""
        seen = self._watched[0]
        term = 1 if seen is None else seen + 1
        doc = {"term": term, "group": self.group, "life": self.life}
        try:
            self.store.put(f"{self._prefix()}{term:012d}.json", json.dumps(doc).encode(), create=True)
        except ObjectExists:
            self.counts["claims_lost"] += 1
            log.info("group %d: term %d was claimed by another group first", self.group, term)
            self._watched = (term, None, time.monotonic())  # the winner gets a whole timeout to beat
            return False
        self.counts["claims"] += 1
        self.term = term
        log.warning("group %d leads term %d: it runs the live side", self.group, term)
        self._write_beat(0)
        self._thread = threading.Thread(target=self._run, name="leader-beat", daemon=True)
        self._thread.start()
        return True

    # ---------------------------------------------------------------------------------------- the leader

    def check(self) -> None:
        """Raise :class:`Deposed` if a newer term than this group's was claimed."""
        if self._deposed.is_set():
            raise Deposed(f"group {self.group}: a newer term than its term {self.term} was claimed; it no longer "
                          "runs the live side (restart it: it rejoins as a follower)")

    def fence(self) -> None:
        """:meth:`check`, after one look at the store for a newer term: the publisher's commit gate calls it just
        before a version becomes visible, so a deposed leader's version fails instead of reaching the engines.
        StoreError when the store cannot be read (the version fails too)."""
        self.check()
        if self.term is not None and self.store.exists(f"{self._prefix()}{self.term + 1:012d}.json"):
            self._deposed.set()
            self.check()

    def _write_beat(self, n: int) -> None:
        doc = {"term": self.term, "group": self.group, "life": self.life, "beat": n}
        self.store.put(self._beat_key(), json.dumps(doc).encode())

    def _run(self) -> None:
        n = 0
        while not self._stop.wait(self.beat_s):
            n += 1
            try:
                self._write_beat(n)
                if self.store.exists(f"{self._prefix()}{self.term + 1:012d}.json"):
                    log.warning("group %d: term %d was claimed; it no longer leads", self.group, self.term + 1)
                    self._deposed.set()
                    return
            except (StoreError, OSError) as exc:
                self.counts["beat_errors"] += 1
                log.warning("group %d: leader heartbeat: %s (retried)", self.group, exc)
            except Exception:  # noqa: BLE001 -- the heartbeat must outlive anything: logged, counted, retried
                self.counts["beat_errors"] += 1
                log.exception("group %d: leader heartbeat", self.group)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
