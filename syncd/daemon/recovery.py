"""Rebuilding an engine's weights: the newest full version, then the delta chain after it.

Used on start and whenever an engine reports a version the daemon does not expect (a restarted engine
comes back with its initial weights), or after an update left its weights matching no version. The
shards come from the node cache first and the store second (the daemon's shard source fills the cache
before this runs). The engine is paused for the whole rebuild and resumed only once its checksums equal
the target manifest's; on any failure it stays paused (it must not serve weights that match no version).
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
    Returns ``{"pause_s"}``. Raises :class:`RebuildFailed` (engine left paused)."""
    if not plan.from_full:
        raise ValueError("a rebuild starts from a full version")
    t0 = time.perf_counter()
    driver._pause()
    try:
        driver.adapter.load_full(Update.from_cache(plan.steps[0], cache_root, raw=raws[0]))
        for m, raw in zip(plan.steps[1:], raws[1:]):
            driver.adapter.stage(Update.from_cache(m, cache_root, raw=raw))
            driver.adapter.apply()
        bad = driver.mismatches(plan.steps[-1])
    except Exception as exc:
        driver.verified, driver.needs_rebuild = False, True
        raise RebuildFailed(f"engine {driver.name}: rebuilding version {plan.target} from full version "
                            f"{plan.steps[0].version} failed: {type(exc).__name__}: {exc}") from exc
    if bad:
        driver.verified, driver.needs_rebuild = False, True
        raise RebuildFailed(f"engine {driver.name}: rebuilt version {plan.target}, but {len(bad)} parameter(s) "
                            f"do not match its checksums (first: {bad[0]})")
    driver.version, driver.verified, driver.needs_rebuild = plan.target, True, False
    driver.applied = set(plan.versions)
    driver.resume()
    driver.settle()
    log.info("engine %s rebuilt at version %d (full %d + %d deltas) in %.3fs", driver.name, plan.target,
             plan.steps[0].version, len(plan.steps) - 1, time.perf_counter() - t0)
    return {"pause_s": time.perf_counter() - t0}
