"""How a publisher numbers its next version in a store that others (an earlier life of the trainer, an attacker, a
crashed upload) may have written: after the run's newest *valid* version, skipping numbers squatted by unusable
manifests, refusing numbers another publisher holds. Used by :class:`syncd.publish.publisher.WeightPublisher`.

Every function reads the store (one GET per manifest, one HEAD per number) and raises
:class:`~syncd.errors.StoreError` when it does not answer."""

from __future__ import annotations

import logging

from syncd import manifest as mf
from syncd.errors import PublishError, StoreError, SyncdError, VersionConflict
from syncd.store import Store

__all__ = ["Squatted", "usable", "free_number", "newest_valid"]

log = logging.getLogger("syncd.publish.publisher")


class Squatted(Exception):
    """The manifest number was taken by an unusable manifest between numbering and writing (``args[0]``)."""


def usable(store: Store, run_id: str, version: int, key) -> bool:
    """True if ``version`` has a manifest that verifies under ``key`` (a falsy key: unsigned only)."""
    from syncd.versions import read_manifest

    try:
        read_manifest(store, run_id, version, signing_key=key or False)
        return True
    except StoreError:
        raise
    except SyncdError:
        return False


def free_number(store: Store, run_id: str, version: int, key, max_skips: int) -> int:
    """``version``, or the first number after it that no manifest occupies: one occupied by an unusable manifest
    (squatted) is skipped with a warning, one occupied by a valid manifest is another publisher's
    (:class:`~syncd.errors.VersionConflict`); :class:`~syncd.errors.PublishError` after ``max_skips`` squatted
    numbers."""
    v = version
    for v in range(version, version + max_skips + 1):
        if v > mf.MAX_VERSION:
            break
        if not store.exists(mf.manifest_key(run_id, v)):
            return v
        if usable(store, run_id, v, key):
            raise VersionConflict(f"run {run_id} version {v} was published by another publisher; "
                                  "two trainers are publishing to one run id")
        log.warning("run %s: version number %d is squatted by an unusable manifest; skipping it", run_id, v)
    raise PublishError(f"run {run_id}: version numbers {version}..{v} are all squatted by unusable "
                       "manifests; remove them (syncd verify) before publishing")


def newest_valid(store: Store, run_id: str, key) -> int | None:
    """The run's newest valid version under ``key`` (falsy: no key, signed manifests refused), via the one
    verified-newest reader (:func:`syncd.versions.latest_version`, i.e. :class:`syncd.newest.VersionPoller`)."""
    from syncd.versions import latest_version

    return latest_version(store, run_id, signing_key=key or False)
