"""Rebuilding an engine's weights: the newest full version, then the delta chain after it.

Used on start and whenever an engine reports a version the daemon does not expect (a restarted engine
comes back with its initial weights), or after an update left its weights matching no version. The
shards come from the node cache first and the store second (the daemon's shard source fills the cache
before this runs). The engine is paused for the whole rebuild and resumed only once its checksums equal
a manifest's: the target's, or, when the engine refuses to stage a delta of the chain (which writes nothing:
a blob it cannot decode, such as a format-2 delta of a tensor it holds only in slices, or a bad cached
shard), the version it reached before it, which it then serves. On any other failure it stays paused (it
must not serve weights that match no version).
"""

from __future__ import annotations

import logging
import time

from syncd.engines.update import Update

log = logging.getLogger(__name__)


class RebuildFailed(RuntimeError):
    """A rebuild did not reach verified weights; the engine stays paused."""


def rebuild_engine(driver, plan, raws: list[bytes], cache_root) -> dict:
    """Blocking: load ``plan.steps[0]`` (a full version) into ``driver``'s engine and apply the deltas
    after it (``raws``: each step's manifest bytes; the shards in the node cache at ``cache_root``), all while
    paused; verify; resume.
    Returns ``{"pause_s", "version", "refused"}``: the version the engine now serves, and None, or, when it
    refused to stage a delta of the chain, what it said (it then serves the version before that delta).
    Raises :class:`RebuildFailed` (engine left paused)."""
    if not plan.from_full:
        raise ValueError("a rebuild starts from a full version")
    t0 = time.perf_counter()
    driver._pause()
    reached, refused = 0, None  # the index in plan.steps of what the engine holds
    try:
        driver.adapter.load_full(Update.from_cache(plan.steps[0], cache_root, raw=raws[0]))
        for i, (m, raw) in enumerate(zip(plan.steps[1:], raws[1:]), 1):
            try:
                driver.adapter.stage(Update.from_cache(m, cache_root, raw=raw))
            except Exception as exc:  # noqa: BLE001 -- nothing was written: the engine holds steps[reached]
                refused = f"staging {m.version}: {type(exc).__name__}: {exc}"
                break
            driver.adapter.apply()
            reached = i
        bad = driver.mismatches(plan.steps[reached])
    except Exception as exc:
        driver.verified, driver.needs_rebuild = False, True
        raise RebuildFailed(f"engine {driver.name}: rebuilding version {plan.target} from full version "
                            f"{plan.steps[0].version} failed: {type(exc).__name__}: {exc}") from exc
    version = plan.steps[reached].version
    if bad:
        driver.verified, driver.needs_rebuild = False, True
        raise RebuildFailed(f"engine {driver.name}: rebuilt version {version}, but {len(bad)} parameter(s) "
                            f"do not match its checksums (first: {bad[0]})")
    driver.version, driver.verified, driver.needs_rebuild = version, True, False
    driver.applied = set(plan.versions[:reached + 1])
    driver.resume()
    driver.settle()
    if refused:
        log.error("engine %s rebuilt only up to version %d (full %d + %d deltas), which it serves: %s", driver.name,
                  version, plan.steps[0].version, reached, refused)
    else:
        log.info("engine %s rebuilt at version %d (full %d + %d deltas) in %.3fs", driver.name, version,
                 plan.steps[0].version, reached, time.perf_counter() - t0)
    return {"pause_s": time.perf_counter() - t0, "version": version, "refused": refused}
