"""The syncd node daemon: keeps a node's engines on the newest verified version of a run.

Modules, one concept each: ``config`` (settings), ``poller`` (noticing versions; the verified manifests come from
:mod:`syncd.manifest_source`), ``planner`` (chain vs newer full version), ``fetcher`` (``ShardSource``: shards into
the node cache, re-hashed before they are trusted), ``stager`` (staging while serving), ``driver`` (one engine: its
checks, lease and critical sections, update and rebuild), ``updates`` (``UpdatePath``, the daemon's collaborator
that moves engine groups: fetch, stage, apply, rebuild, heal and trim the cache), ``metrics`` (Prometheus),
``status`` (the status file), ``points`` (named points of the update path an observer can hold), ``cluster`` (the
daemon as a node of a cluster: flags, ``ClusterLink``), and ``daemon`` (``NodeDaemon``, the loop, supervision and
signal handling). :func:`run` runs one on uvloop.

The names below are imported on first use, so that ``syncd status`` or building the command line does not
load the engines' machinery (torch).
"""

from __future__ import annotations

import asyncio

from syncd.lazy import lazy_names

_LAZY = {
    "DaemonConfig": "syncd.daemon.config",
    "EngineSpec": "syncd.daemon.config",
    "NodeDaemon": "syncd.daemon.daemon",
    "ShardSource": "syncd.daemon.fetcher",
    "StoreShardSource": "syncd.daemon.fetcher",
}

__all__ = sorted(_LAZY) + ["run"]


__getattr__ = lazy_names("syncd.daemon", _LAZY)


def run(daemon: NodeDaemon) -> None:
    """Run ``daemon`` until SIGTERM/SIGINT on an asyncio event loop (uvloop where installed)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover -- uvloop is a dependency on Linux/macOS
        asyncio.run(daemon.run())
        return
    uvloop.run(daemon.run())
