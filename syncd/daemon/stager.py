"""Staging a version on a group of engines while they serve.

In-process engines share one ``engine.Update`` built from the node cache (the shards are read once);
engines in other processes get the manifest and the cache path and build it themselves
(``engine.control``). All engines of the group stage concurrently; none is paused.
"""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger(__name__)


async def stage_group(drivers, manifest_raw: bytes, cache_root) -> None:
    """Stage the version ``manifest_raw`` (shards in ``cache_root``) on every driver's engine. Raises the
    first failure after all stagings have ended (a staged, unapplied update is harmless: the next stage
    replaces it)."""
    from syncd.cache import update_from_cache

    local = [d for d in drivers if not d.remote]
    remote = [d for d in drivers if d.remote]
    calls = [asyncio.to_thread(d.adapter.stage_from_cache, manifest_raw, cache_root) for d in remote]
    if local:
        update = await asyncio.to_thread(update_from_cache, manifest_raw, cache_root)
        calls += [asyncio.to_thread(d.adapter.stage, update) for d in local]
    results = await asyncio.gather(*calls, return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise errors[0]
