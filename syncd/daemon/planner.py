"""Planning the path from an engine's version to the newest one.

The versions of a run form chains: a full version F, then deltas F+1, F+2, ... each made against the
one before, until the next full version. Walking back from a target T along ``base_version`` therefore
reaches the newest full version at or below T. From an engine at version C there are at most two paths:

* the delta chain C+1..T, when C lies on T's walk back (C >= F), and
* the full version F followed by the deltas F+1..T (always possible; the only one when C < F or C is
  unknown).

With the publisher's layout the walk back already gives the cheaper one: the chain when no full version
lies between C and T, else the newest full version plus its deltas, never an older chain replayed up to
a full version that overwrites it anyway. Where both paths exist the planner still compares their shard
bytes and takes the smaller. It never plans a version the engine already holds, and never goes backwards.
When T cannot be reached (a version on the way was rejected or is gone), it tries T-1, T-2, ... down to
the engine's version.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from syncd import manifest as mf
from syncd import versions
from syncd.errors import ManifestError, VersionNotFound

log = logging.getLogger(__name__)

MAX_TARGETS = 64  # how far below an unreachable newest version the planner looks


@dataclass(frozen=True)
class Plan:
    """Versions to apply in order: ``steps[0]`` applies to ``current`` (a delta with that base) or is a
    full version (``from_full``); each later step is a delta on the one before; the last is ``target``."""

    current: int | None
    target: int
    steps: tuple[mf.Manifest, ...]
    from_full: bool

    @property
    def bytes(self) -> int:
        """Shard bytes of every step (what the plan downloads when nothing is cached)."""
        return sum(m.total_bytes for m in self.steps)

    @property
    def versions(self) -> list[int]:
        return [m.version for m in self.steps]


def walk_back(manifests, target: int) -> list[mf.Manifest] | None:
    """Verified manifests from the newest full version at or below ``target`` up to ``target``, each delta
    checked against its base; None if a version on the way is gone or refused (the refusal is recorded by
    ``manifests``). Raises :class:`~syncd.errors.StoreError` if the store cannot be read."""
    try:
        return list(versions.walk_back(manifests.get, target, check=manifests.check_link))[::-1]
    except (VersionNotFound, ManifestError) as exc:
        log.info("version %d cannot be reached: %s", target, exc)
        return None


def plan_update(manifests, current: int | None, newest: int, *, max_targets: int = MAX_TARGETS) -> Plan | None:
    """The cheapest :class:`Plan` from ``current`` (None: weights unknown, rebuild) towards ``newest``;
    None when there is nothing to do or no version above ``current`` can be reached.

    ``manifests`` is a :class:`~syncd.manifest_source.ManifestSource` (``get``, ``check_link``,
    ``rejected``). Blocking (reads manifests from the cache or the store)."""
    floor = -1 if current is None else current
    for target in range(newest, max(floor, newest - max_targets), -1):
        if manifests.rejected(target):
            continue
        path = walk_back(manifests, target)
        if path is None:
            continue
        full = Plan(current, target, tuple(path), True)
        versions = [m.version for m in path]
        if current is not None and current in versions:
            chain = Plan(current, target, tuple(path[versions.index(current) + 1:]), False)
            if chain.bytes <= full.bytes:
                return chain
            log.info("version %d: full version %d + %d deltas (%d bytes) beat the %d-delta chain from %d "
                     "(%d bytes)", target, path[0].version, len(path) - 1, full.bytes, len(chain.steps), current,
                     chain.bytes)
        return full
    return None
