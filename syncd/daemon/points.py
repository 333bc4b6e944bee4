"""Named points of the update path where an observer can look, or hold the daemon: ``download`` (a shard fetched
and checked, not yet in the node cache; context ``cache``, ``sha256``, ``data``), ``stage`` (a version staged on
the engines, none paused) and ``apply`` (an engine paused and applied, before its checksum check). Each is called
with the version it concerns.

Nothing happens at a point unless an observer was installed (:func:`install`; the process tests hold a daemon at
one so that they can kill it there: ``tests/daemon/_hooks.py``); then it runs on the thread that reached the
point and may block it. Costs one empty-list check per point otherwise.
"""

from __future__ import annotations

__all__ = ["POINTS", "install", "reached"]

POINTS = ("download", "stage", "apply")
_observers: list = []


def install(observer) -> None:
    """Call ``observer(point, version, **context)`` at every point from now on."""
    _observers.append(observer)


def reached(point: str, version: int | None = None, **context) -> None:
    """The update path reached ``point`` (one of :data:`POINTS`) for ``version``."""
    for observer in _observers:
        observer(point, version, **context)
