"""Retention: which versions of a run to keep, and deleting the rest safely while readers may still use them.

Thread-safety: functions are reentrant; they share nothing but the :class:`~syncd.store.Store` (thread-safe).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timezone

from syncd import manifest as mf
from syncd.errors import VersionNotFound
from syncd.store import Store
from syncd.versions import list_versions, walk_back

log = logging.getLogger(__name__)

__all__ = ["RetentionPolicy", "RetentionPlan", "plan_retention", "apply_retention"]


@dataclass(frozen=True)
class RetentionPolicy:
    """What to keep. The newest ``keep_last`` versions stay materializable: they and every version in
    their base chains are kept. A version outside that set is deleted only once no reader can still be
    using it: ``grace_s`` seconds after the last version depending on it stopped being the newest. Version
    directories without a manifest, and shards a manifest does not name, are deleted once their newest
    object is ``orphan_grace_s`` old (a slow upload in progress is never touched before that)."""

    keep_last: int = 8
    grace_s: float = 300.0
    orphan_grace_s: float = 3600.0

    def __post_init__(self):
        if self.keep_last < 1:
            raise ValueError("keep_last must be at least 1 (the newest version is always kept)")
        if self.grace_s < 0 or self.orphan_grace_s < 0:
            raise ValueError("grace periods must not be negative")


@dataclass
class RetentionPlan:
    """Outcome of :func:`plan_retention`: versions to keep / delete, object keys to delete, problems seen."""

    keep: list[int] = field(default_factory=list)
    #: why each kept version is kept: "newest" (one of the newest keep_last), "base" (in a kept version's base
    #: chain), "grace" (superseded less than grace_s ago: a reader may still use it)
    keep_reasons: dict[int, str] = field(default_factory=dict)
    delete_versions: list[int] = field(default_factory=list)
    delete_keys: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def plan_retention(store, run_id: str, policy: RetentionPolicy, *, signing_key=None,
                   now: datetime | None = None) -> RetentionPlan:
    """Decide what :func:`apply_retention` would delete; reads the store, changes nothing.

    Versions whose manifest does not verify are never deleted (they are reported in ``problems``), and
    nothing that a valid retained version's chain needs is ever deleted."""
    store = Store.open(store, create=False)
    now = now or datetime.now(timezone.utc)
    infos = list_versions(store, run_id, signing_key=signing_key)
    valid = {i.version: i for i in infos if i.manifest is not None}
    order = sorted(valid)
    plan = RetentionPlan()
    for i in infos:
        if i.error:
            plan.problems.append(f"version {i.version}: {i.error}")

    def get(v: int) -> mf.Manifest:
        if v not in valid:
            raise VersionNotFound(v)
        return valid[v].manifest

    def chain(v: int) -> list[int]:
        out = []
        try:
            for m in walk_back(get, v):
                out.append(m.version)
        except VersionNotFound:
            plan.problems.append(f"version {v}: base version {valid[out[-1]].manifest.base_version} is missing; "
                                 "it cannot be materialized")
        return out

    chains = {v: chain(v) for v in order}
    needed = {b for v in order[-policy.keep_last:] for b in chains[v]}
    # when did each version stop being usable by a reader that picked some dependent version as newest?
    released: dict[int, datetime] = {}
    for v, nxt in zip(order, order[1:]):
        t = valid[nxt].manifest.created_datetime
        for b in chains[v]:
            released[b] = max(released.get(b, t), t)
    prefix = mf.run_prefix(run_id)
    shards_to_delete = []
    newest = set(order[-policy.keep_last:])
    for v in order:
        if v in needed or (now - released[v]).total_seconds() < policy.grace_s:
            plan.keep.append(v)
            plan.keep_reasons[v] = "newest" if v in newest else "base" if v in needed else "grace"
            continue
        plan.delete_versions.append(v)
        shards_to_delete += [o.key for o in valid[v].objects if o.key != mf.manifest_key(run_id, v)]
    # manifests first: each deleted version vanishes at once for readers; then its shards
    plan.delete_keys = [mf.manifest_key(run_id, v) for v in plan.delete_versions] + shards_to_delete
    for i in infos:
        if i.error is not None or i.version in plan.delete_versions:
            continue  # a version whose manifest does not verify is left for a person to look at
        named = {mf.manifest_key(run_id, i.version)}
        if i.manifest is not None:
            named |= {prefix + s.key for s in i.manifest.shards}
        stray = [o for o in i.objects if o.key not in named]
        if stray and all((now - o.last_modified).total_seconds() >= policy.orphan_grace_s for o in stray):
            plan.delete_keys += [o.key for o in stray]
    return plan


def apply_retention(store, run_id: str, policy: RetentionPolicy, *, signing_key=None,
                    dry_run: bool = False) -> RetentionPlan:
    """Plan (see :func:`plan_retention`) and delete. Each version's manifest is deleted before its shards,
    so a concurrent reader sees the version either whole or gone. Safe to run from several processes."""
    store = Store.open(store, create=False)
    plan = plan_retention(store, run_id, policy, signing_key=signing_key)
    if not dry_run and plan.delete_keys:
        n_manifests = len(plan.delete_versions)
        store.delete(plan.delete_keys[:n_manifests])
        store.delete(plan.delete_keys[n_manifests:])
        log.info("retention of run %s: deleted versions %s and %d objects; keeping %s", run_id,
                 plan.delete_versions, len(plan.delete_keys), plan.keep)
    for p in plan.problems:
        log.warning("retention of run %s: %s", run_id, p)
    return plan
