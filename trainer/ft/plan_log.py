"""The elastic job's plan log: step ``N``'s plan, written once by the live side, read by every replica group.

    runs/<run>/trainer/plans/<12 digits>.json     {"step": N, "plan": {...}, "signature": {...}}

A plan is written create-if-absent before any group trains it and never changes: a step that fails and is
retried, a group that rejoins, a restarted live side -- all train step ``N`` on the same plan, so no prompt is
trained twice and a rejoining group computes exactly what the others do. Entries are HMAC-signed with the run's
key when one is set, and read as hostile input (bounded strict JSON, the step checked, the signature verified).
Thread-safety: stateless but for a small cache; one reader per thread.
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

__all__ = ["PlanLog", "PlanLogError"]

MAX_PLAN_BYTES = 64 << 20


class PlanLogError(SyncdError, ValueError):
    """A plan log entry that is not one (malformed, another step's, or its signature does not verify)."""


def _message(doc: dict):
    body = {k: v for k, v in doc.items() if k != "signature"}
    return lambda alg, key_id: json.dumps({"body": body, "alg": alg, "key_id": key_id}, sort_keys=True,
                                          separators=(",", ":")).encode()


class PlanLog:
    """See the module docstring. ``signing_key`` as in :func:`syncd.signing.resolve_key`."""

    def __init__(self, store, run_id: str, *, signing_key=None):
        self.store, self.run_id = Store.open(store), mf.check_run_id(run_id)
        self.key = resolve_key(signing_key)
        self._cache: dict[int, dict] = {}

    def _key(self, step: int) -> str:
        return f"{mf.run_prefix(self.run_id)}trainer/plans/{int(step):012d}.json"

    def put(self, step: int, plan: dict) -> dict:
        """Log ``plan`` as step ``step``'s; if an entry is there already, that one is the step's plan and is
        returned instead."""
        doc = {"step": int(step), "plan": plan}
        if self.key is not None:
            doc["signature"] = signature_for(_message(doc), self.key)
        try:
            self.store.put(self._key(step), json.dumps(doc, sort_keys=True, allow_nan=False).encode(), create=True)
        except ObjectExists:
            return self.get(step)
        self._cache[step] = plan
        return plan

    def get(self, step: int) -> dict | None:
        """Step ``step``'s plan, None when not logged yet; PlanLogError for an entry that does not verify."""
        if step in self._cache:
            return self._cache[step]
        where = f"{self.store.url}/{self._key(step)}"
        try:
            raw = self.store.get_bounded(self._key(step), MAX_PLAN_BYTES)
        except ObjectNotFound:
            return None
        doc = jsonsafe.loads(raw, what=where, max_bytes=MAX_PLAN_BYTES, max_depth=16, error=PlanLogError)
        if not isinstance(doc, dict) or doc.get("step") != step or not isinstance(doc.get("plan"), dict) \
                or not isinstance(doc["plan"].get("groups"), list):
            raise PlanLogError(f"{where}: not the plan of step {step}")
        try:
            check_signature(_message(doc), doc.get("signature"), self.key, where)
        except SyncdError as exc:
            raise PlanLogError(str(exc)) from None
        self._cache[step] = doc["plan"]
        for old in [s for s in self._cache if s < step - 64]:
            del self._cache[old]
        return doc["plan"]

    def wait(self, step: int, timeout_s: float, *, poll_s: float = 0.05) -> dict:
        """Step ``step``'s plan once logged; TimeoutError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        wait = poll_s
        while True:
            plan = self.get(step)
            if plan is not None:
                return plan
            if time.monotonic() > deadline:
                raise TimeoutError(f"no plan for step {step} in the plan log after {timeout_s:.0f} s (the live side, "
                                   "replica group 0, is down?)")
            time.sleep(wait)
            wait = min(1.0, wait * 1.5)
