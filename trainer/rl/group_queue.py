"""The rollout queue in the object store: what the rollout service (:mod:`syncd.trainer.rl.rollout_service`) sends,
what it finished, and what the trainer consumed or sent back -- durable, and exactly once per attempt.

Every object below is written once (``Store.put(create=True)``) except the consumer's position; so a writer that
dies at any point leaves a state that a restarted one reads back whole, and two writers of one name cannot both
win. Under ``runs/<run>/rollouts/``:

* ``attempts/<index>-<attempt>.json`` -- the **claim**, written *before* any request of attempt ``attempt`` of prompt
  ``index`` is sent: ``{"index", "attempt", "service", "life", "proxy", "trajectories", "requested_version"}``. No
  attempt is sent twice, whoever restarts: a second claim of one attempt fails.
* ``groups/<service>/<page>/<slot>-<index>-<attempt>.json`` -- a **finished group** (its plan: item, trajectories,
  rewards, versions, token versions, attempt), the ``seq``-th of its service (``page = seq // PAGE``,
  ``slot = seq % PAGE``): a consumer lists one page to find what is new.
* ``failed/<index>-<attempt>.json`` -- an attempt that will never be trained: its group failed in the service, was
  orphaned by a service restart, or was sent back by the trainer (dropped by the buffer policy, refused by its
  checks). ``{"index", "attempt", "reason", "by"}``. The prompt is regenerated as ``attempt + 1``: none is lost.
* ``consumer.json`` -- the trainer's position (overwritten by its one writer): ``{"read": {service: next seq},
  "step", "version"}``; a service bounds its backlog by it.

Every object read is hostile until checked: its size is bounded, its members typed and ranged
(:class:`QueueError` names the key and what is wrong; a reader skips and counts such an object, never trusts it).
Thread-safety: a :class:`GroupQueue` holds no state of its own beyond the store; safe to share.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field

from syncd import jsonsafe
from syncd.errors import ObjectNotFound, ObjectTooLarge
from syncd.manifest import run_prefix
from syncd.store import Store

__all__ = ["GroupQueue", "QueueError", "QueueState", "PAGE", "MAX_OBJECT_BYTES"]

PAGE = 1000
MAX_OBJECT_BYTES = 16 << 20
MAX_INDEX = 10 ** 10 - 1
MAX_ATTEMPT = 999
_SERVICE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_ATTEMPT_NAME = re.compile(r"^(\d{10})-(\d{3})\.json$")
_GROUP_NAME = re.compile(r"^(\d{9})/(\d{3})-(\d{10})-(\d{3})\.json$")


class QueueError(ValueError):
    """An object of the rollout queue that is not what its name says (the message names the key)."""


def check_service(name) -> str:
    """``name`` if it is a valid rollout service id (1-64 of ``[A-Za-z0-9._-]``, starting alphanumeric)."""
    if not isinstance(name, str) or not _SERVICE.match(name):
        raise ValueError(f"invalid rollout service id {name!r}: use 1-64 characters of [A-Za-z0-9._-], starting "
                         "with a letter or digit")
    return name


def _check_attempt(index, attempt) -> None:
    for what, v, top in (("index", index, MAX_INDEX), ("attempt", attempt, MAX_ATTEMPT)):
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= top:
            raise ValueError(f"a prompt {what} must be an integer in 0..{top}, got {v!r}")


@dataclass
class QueueState:
    """What a service's part of the queue holds (:meth:`GroupQueue.state`): ``claims`` ``{(index, attempt): key}``,
    ``landed`` ``{(index, attempt): seq}``, ``failed`` ``{(index, attempt): reason}``, ``next_seq`` (the next group's
    number), ``skipped`` (objects whose names or contents did not check, by key)."""

    claims: dict = field(default_factory=dict)
    landed: dict = field(default_factory=dict)
    failed: dict = field(default_factory=dict)
    next_seq: int = 0
    skipped: dict = field(default_factory=dict)


class GroupQueue:
    """The queue of run ``run_id`` in ``store`` (a :class:`syncd.store.Store` or its URL); see the module docstring.
    Store failures raise :class:`syncd.errors.StoreError` (after the store's own retries)."""

    def __init__(self, store, run_id: str):
        self.store = Store.open(store)
        self.run_id = run_id
        self.prefix = run_prefix(run_id) + "rollouts/"

    # ------------------------------------------------------------------------------------ keys

    def attempt_key(self, index: int, attempt: int) -> str:
        _check_attempt(index, attempt)
        return f"{self.prefix}attempts/{index:010d}-{attempt:03d}.json"

    def failed_key(self, index: int, attempt: int) -> str:
        _check_attempt(index, attempt)
        return f"{self.prefix}failed/{index:010d}-{attempt:03d}.json"

    def group_key(self, service: str, seq: int, index: int, attempt: int) -> str:
        _check_attempt(index, attempt)
        return f"{self.prefix}groups/{check_service(service)}/{seq // PAGE:09d}/{seq % PAGE:03d}-{index:010d}-" \
               f"{attempt:03d}.json"

    # ------------------------------------------------------------------------------------ writing

    def claim(self, index: int, attempt: int, entry: dict) -> None:
        """Claim attempt ``attempt`` of prompt ``index`` before sending it; :class:`syncd.errors.ObjectExists`
        when it was claimed before (it must not be sent again)."""
        doc = {**entry, "index": index, "attempt": attempt, "t": time.time()}
        self.store.put(self.attempt_key(index, attempt), _dump(doc), create=True)

    def fail(self, index: int, attempt: int, reason: str, *, by: str) -> bool:
        """Mark the attempt as never to be trained; False when it was marked before (the first reason stands)."""
        from syncd.errors import ObjectExists

        doc = {"index": index, "attempt": attempt, "reason": str(reason)[:500], "by": by, "t": time.time()}
        try:
            self.store.put(self.failed_key(index, attempt), _dump(doc), create=True)
            return True
        except ObjectExists:
            return False

    def append(self, service: str, seq: int, doc: dict) -> str:
        """Write finished group ``doc`` (its ``item.index`` and ``attempt``) as its service's ``seq``-th; returns
        the key. :class:`syncd.errors.ObjectExists` when that number was taken (another writer of ``service``)."""
        key = self.group_key(service, seq, int(doc["item"]["index"]), int(doc["attempt"]))
        self.store.put(key, _dump({**doc, "service": service, "seq": seq}), create=True)
        return key

    def set_consumer(self, read: dict, **extra) -> None:
        """The consumer's position: ``read`` ``{service: next seq}`` (and e.g. its ``step``, ``version``)."""
        self.store.put(self.prefix + "consumer.json", _dump({"read": dict(read), **extra, "t": time.time()}))

    # ------------------------------------------------------------------------------------ reading

    def consumer(self) -> dict:
        """The consumer's position (``{"read": {}}`` when none was written); a malformed one raises QueueError."""
        key = self.prefix + "consumer.json"
        try:
            doc = self._load(key)
        except ObjectNotFound:
            return {"read": {}}
        read = doc.get("read")
        if not isinstance(read, dict) or not all(isinstance(k, str) and _count(v) for k, v in read.items()):
            raise QueueError(f"{key}: 'read' must map service ids to counts, got {str(read)[:200]}")
        return doc

    def services(self) -> list[str]:
        """The services that wrote groups."""
        return [d for d in self.store.list_dirs(self.prefix + "groups/") if _SERVICE.match(d)]

    def read_groups(self, service: str, start: int, *, limit: int = PAGE) -> tuple[list, int]:
        """The groups of ``service`` from number ``start`` on, in order, as far as they are contiguous (at most
        ``limit``; one store listing per page touched): ``(items, the next number to read)``, an item being the
        group's doc or, for an object that does not check, the :class:`QueueError` naming it (its number is
        passed: the consumer counts it and sends the attempt back)."""
        out, seq = [], start
        while len(out) < limit:
            page = seq // PAGE
            names = self._page(service, page)
            while len(out) < limit and seq // PAGE == page and (seq % PAGE) in names:
                try:
                    out.append(self._group(names[seq % PAGE], service, seq))
                except (QueueError, ObjectNotFound) as exc:
                    out.append(exc if isinstance(exc, QueueError) else QueueError(str(exc)))
                seq += 1
            if seq // PAGE == page:  # a gap in this page: the next group is not written yet
                break
        return out, seq

    @staticmethod
    def attempt_of(key_or_error) -> tuple[int, int] | None:
        """``(index, attempt)`` named by a group object's key (in a :class:`QueueError`'s message too)."""
        m = re.search(r"/\d{3}-(\d{10})-(\d{3})\.json", str(key_or_error))
        return (int(m.group(1)), int(m.group(2))) if m else None

    def state(self, service: str, *, accept=None) -> QueueState:
        """Every claim, landed group of ``service`` and failure, from listings alone (``claims`` maps an attempt to
        its key: :meth:`read_claim` reads the few a caller needs); ``accept(index)``: only prompts of this service's
        share."""
        st = QueueState()
        accept = accept or (lambda index: True)
        for info in self.store.list(self.prefix + "attempts/"):
            got = self._name(info.key, "attempts/", _ATTEMPT_NAME, st)
            if got is not None and accept(got[0]):
                st.claims[got] = info.key
        for info in self.store.list(self.prefix + "failed/"):
            got = self._name(info.key, "failed/", _ATTEMPT_NAME, st)
            if got is not None and accept(got[0]):
                st.failed[got] = "failed"
        base = f"{self.prefix}groups/{check_service(service)}/"
        for info in self.store.list(base):
            m = _GROUP_NAME.match(info.key[len(base):])
            if m is None:
                st.skipped[info.key] = "not a group object's name"
                continue
            seq = int(m.group(1)) * PAGE + int(m.group(2))
            st.landed[(int(m.group(3)), int(m.group(4)))] = seq
            st.next_seq = max(st.next_seq, seq + 1)
        return st

    def read_claim(self, index: int, attempt: int) -> dict:
        """The claim of an attempt (its trajectories, proxy, service, life); :class:`QueueError` when it is not one,
        :class:`syncd.errors.ObjectNotFound` when there is none."""
        key = self.attempt_key(index, attempt)
        doc = self._load(key)
        if (doc.get("index"), doc.get("attempt")) != (index, attempt) or not isinstance(doc.get("trajectories"), list):
            raise QueueError(f"{key}: names another attempt or has no trajectories")
        return doc

    def _page(self, service: str, page: int) -> dict[int, str]:
        base = f"{self.prefix}groups/{check_service(service)}/{page:09d}/"
        out = {}
        for info in self.store.list(base):
            m = re.match(r"^(\d{3})-\d{10}-\d{3}\.json$", info.key[len(base):])
            if m is not None:
                out[int(m.group(1))] = info.key
        return out

    def _group(self, key: str, service: str, seq: int) -> dict:
        doc = self._load(key)
        item, m = doc.get("item"), _GROUP_NAME.match(key.split(f"/groups/{service}/", 1)[-1])
        if not isinstance(item, dict) or m is None or doc.get("service") != service or doc.get("seq") != seq \
                or item.get("index") != int(m.group(3)) or doc.get("attempt") != int(m.group(4)):
            raise QueueError(f"{key}: its contents name another group than its key")
        for name, kind in (("trajectories", list), ("rewards", list), ("versions", dict)):
            if not isinstance(doc.get(name), kind) or (kind is list and not doc[name]):
                raise QueueError(f"{key}: {name!r} must be a non-empty {kind.__name__}")
        pairs = all(isinstance(t, list) and len(t) == 2 and all(isinstance(x, str) for x in t)
                    for t in doc["trajectories"])
        if len(doc["trajectories"]) != len(doc["rewards"]) or not pairs:
            raise QueueError(f"{key}: 'trajectories' must be one [sandbox, trajectory] pair per reward")
        if not all(isinstance(r, (int, float)) and not isinstance(r, bool) and r == r and abs(r) != float("inf")
                   for r in doc["rewards"]):
            raise QueueError(f"{key}: 'rewards' must be finite numbers")
        return doc

    def _name(self, key: str, sub: str, pattern, st: QueueState):
        m = pattern.match(key[len(self.prefix + sub):])
        if m is None:
            st.skipped[key] = "not a queue object's name"
            return None
        return int(m.group(1)), int(m.group(2))

    def _load(self, key: str) -> dict:
        try:
            doc = jsonsafe.loads(self.store.get_bounded(key, MAX_OBJECT_BYTES), what=key, max_bytes=MAX_OBJECT_BYTES)
        except (ValueError, ObjectTooLarge) as exc:
            raise QueueError(str(exc)) from None
        if not isinstance(doc, dict):
            raise QueueError(f"{key}: not a JSON object")
        return doc


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _dump(doc: dict) -> bytes:
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
