"""The elastic job's step logs in the store: one entry per step, written create-if-absent, read by every replica
group.

    runs/<run>/trainer/plans/<12 digits>.json        {"step": N, "plan": {...}, "signature": {...}}
    runs/<run>/trainer/live-state/<12 digits>.json   {"step": N, "state": {...}, "signature": {...}}

:class:`PlanLog`: step ``N``'s plan, written by the live side before any group trains it, never changed: a step
that fails and is retried, a group that rejoins, a live side that moved to another group -- all train step ``N``
on the same plan, so no prompt is trained twice and a rejoining group computes exactly what the others do.

:class:`LiveStateLog`: the live side's RL state after step ``N`` committed (:meth:`syncd.trainer.rl.live.LiveSide.snapshot`),
from which another replica group takes the live side over (:mod:`syncd.trainer.rl.leadership`); only the newest
few are kept.

Entries are HMAC-signed with the run's key when one is set, and read as hostile input (bounded strict JSON, the
step checked, the signature verified). Thread-safety: stateless but for a small cache; one reader per thread.
"""

from __future__ import annotations

import json
import logging
import time

from syncd import jsonsafe
from syncd import manifest as mf
from syncd.errors import ObjectExists, ObjectNotFound, SyncdError
from syncd.signing import check_signature, resolve_key, signature_for
from syncd.store import Store

log = logging.getLogger(__name__)

__all__ = ["PlanLog", "LiveStateLog", "PlanLogError"]

MAX_PLAN_BYTES = 64 << 20


class PlanLogError(SyncdError, ValueError):
    """A plan log entry that is not one (malformed, another step's, or its signature does not verify)."""


def _message(doc: dict):
    body = {k: v for k, v in doc.items() if k != "signature"}
    return lambda alg, key_id: json.dumps({"body": body, "alg": alg, "key_id": key_id}, sort_keys=True,
                                          separators=(",", ":")).encode()


class _StepLog:
    """One entry per step under ``trainer/<folder>/``, its body in the member ``field`` (module docstring).
    ``signing_key`` as in :func:`syncd.signing.resolve_key`."""

    folder = field = ""

    def __init__(self, store, run_id: str, *, signing_key=None):
        self.store, self.run_id = Store.open(store), mf.check_run_id(run_id)
        self.key = resolve_key(signing_key)
        self._cache: dict[int, dict] = {}

    def _prefix(self) -> str:
        return f"{mf.run_prefix(self.run_id)}trainer/{self.folder}/"

    def _key(self, step: int) -> str:
        return f"{self._prefix()}{int(step):012d}.json"

    def _valid(self, body: dict) -> bool:
        return True

    def put(self, step: int, body: dict) -> dict:
        """Log ``body`` as step ``step``'s; if an entry is there already, that one is the step's and is returned
        instead."""
        doc = {"step": int(step), self.field: body}
        if self.key is not None:
            doc["signature"] = signature_for(_message(doc), self.key)
        try:
            self.store.put(self._key(step), json.dumps(doc, sort_keys=True, allow_nan=False).encode(), create=True)
        except ObjectExists:
            return self.get(step)
        self._cache[step] = body
        return body

    def get(self, step: int) -> dict | None:
        """Step ``step``'s entry, None when not logged yet; PlanLogError for an entry that does not verify."""
        if step in self._cache:
            return self._cache[step]
        where = f"{self.store.url}/{self._key(step)}"
        try:
            raw = self.store.get_bounded(self._key(step), MAX_PLAN_BYTES)
        except ObjectNotFound:
            return None
        doc = jsonsafe.loads(raw, what=where, max_bytes=MAX_PLAN_BYTES, max_depth=16, error=PlanLogError)
        if not isinstance(doc, dict) or doc.get("step") != step or not isinstance(doc.get(self.field), dict) \
                or not self._valid(doc[self.field]):
            raise PlanLogError(f"{where}: not the {self.field} of step {step}")
        try:
            check_signature(_message(doc), doc.get("signature"), self.key, where)
        except SyncdError as exc:
            raise PlanLogError(str(exc)) from None
        self._cache[step] = doc[self.field]
        for old in [s for s in self._cache if s < step - 64]:
            del self._cache[old]
        return doc[self.field]

    def steps(self) -> list[int]:
        """The steps logged, ascending (names that are not an entry's are ignored)."""
        out = []
        for info in self.store.list(self._prefix()):
            name = info.key.rsplit("/", 1)[-1]
            if len(name) == 17 and name.endswith(".json") and name[:12].isdigit():
                out.append(int(name[:12]))
        return sorted(out)


class PlanLog(_StepLog):
    """Step ``N``'s plan (module docstring)."""

    folder, field = "plans", "plan"

    def _valid(self, body: dict) -> bool:
        return isinstance(body.get("groups"), list)

    def wait(self, step: int, timeout_s: float, *, poll_s: float = 0.05, until=None) -> dict | None:
        """Step ``step``'s plan once logged, polled every ``poll_s`` growing to 1 s; None as soon as ``until()``
        (asked after each look that found none) is true; TimeoutError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        wait = poll_s
        while True:
            plan = self.get(step)
            if plan is not None:
                return plan
            if until is not None and until():
                return None
            if time.monotonic() > deadline:
                raise TimeoutError(f"no plan for step {step} in the plan log after {timeout_s:.0f} s (is the "
                                   "replica group that runs the live side down, or waiting for rollouts?)")
            time.sleep(wait)
            wait = min(1.0, wait * 1.5)


class LiveStateLog(_StepLog):
    """The live side's RL state after step ``N`` (module docstring)."""

    folder, field = "live-state", "state"

    def _valid(self, body: dict) -> bool:
        return isinstance(body.get("step"), int) and isinstance(body.get("version"), int)

    def newest(self, at_most: int) -> tuple[int, dict] | None:
        """``(step, state)`` of the newest entry at or before step ``at_most`` that verifies (one that does not is
        logged and the next older tried); None when there is none."""
        for step in reversed([s for s in self.steps() if s <= at_most]):
            try:
                state = self.get(step)
            except PlanLogError as exc:
                log.warning("skipping a live state: %s", exc)
                continue
            if state is not None:
                return step, state
        return None

    def prune(self, below: int) -> None:
        """Delete the entries of steps before ``below`` (best effort: a failure is logged)."""
        old = [self._key(s) for s in self.steps() if s < below]
        if old:
            try:
                self.store.delete(old)
            except SyncdError as exc:
                log.warning("pruning old live states: %s", exc)
