"""The syncd node daemon: keeps a node's engines on the newest verified version of a run.

Modules, one concept each: ``config`` (settings), ``poller`` (noticing versions), ``manifests`` (verified
manifests, rejections), ``planner`` (chain vs newer full version), ``fetcher`` (``ShardSource``: shards
into the node cache), ``stager`` (staging while serving), ``driver`` (one engine's critical section),
``recovery`` (rebuilds), ``metrics`` (Prometheus), ``status`` (the status file), ``testhooks``, and
``daemon`` (``NodeDaemon``, the loop and signal handling). :func:`run` runs one on uvloop.
"""

from __future__ import annotations

import asyncio

from syncd.daemon.config import DaemonConfig, EngineSpec
from syncd.daemon.daemon import NodeDaemon
from syncd.daemon.fetcher import ShardSource, StoreShardSource

__all__ = ["DaemonConfig", "EngineSpec", "NodeDaemon", "ShardSource", "StoreShardSource", "run"]


def run(daemon: NodeDaemon) -> None:
    """Run ``daemon`` until SIGTERM/SIGINT on an asyncio event loop (uvloop where installed)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover -- uvloop is a dependency on Linux/macOS
        asyncio.run(daemon.run())
        return
    uvloop.run(daemon.run())
