"""Staging a version on a group of engines while they serve.

Every engine of the group is given the same :class:`~syncd.engines.update.Update` of the version in the node
cache: engines in this process read it from there once between them, engines in other processes are sent
the manifest and the cache path and read it themselves (``syncd.engines``). All engines of the group stage
concurrently; none is paused.
"""

from __future__ import annotations

import asyncio
import logging

from syncd.engines.update import Update

log = logging.getLogger(__name__)


async def stage_group(drivers, manifest, manifest_raw: bytes, cache_root) -> dict:
    """Stage version ``manifest`` (verified; ``manifest_raw``: its exact bytes; shards in ``cache_root``) on
    every driver's engine. Returns ``{driver: exception}`` for the engines that refused it, once all stagings
    have ended (empty: every engine staged it); one engine's refusal does not hold back the others (a staged,
    unapplied update is harmless: the next stage replaces it). Cancellation propagates."""
    update = Update.from_cache(manifest, cache_root, raw=manifest_raw)
    results = await asyncio.gather(*(asyncio.to_thread(d.adapter.stage, update) for d in drivers),
                                   return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException) and not isinstance(r, Exception):
            raise r
    return {d: r for d, r in zip(drivers, results) if isinstance(r, Exception)}
