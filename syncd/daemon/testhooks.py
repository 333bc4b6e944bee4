"""Test hooks: make the daemon stop at a named point so a test can kill it there deterministically.

``SYNCD_TEST_PAUSE_AT=POINT[@VERSION][:SECONDS]`` (comma-separated for several) makes the daemon, on
reaching ``POINT`` (for ``VERSION`` only, if given), create the file ``$SYNCD_TEST_MARK_DIR/POINT`` and
sleep ``SECONDS`` (default 3600) before going on. Points: ``download`` (half of a shard written to
``tmp/``), ``stage`` (a version staged on the engines, none paused yet), ``apply`` (an engine paused and
applied, before its checksum check and resume). Unset in production; costs one dict lookup per point.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)
ENV = "SYNCD_TEST_PAUSE_AT"
ENV_MARK_DIR = "SYNCD_TEST_MARK_DIR"
POINTS = ("download", "stage", "apply")


def _parse(text: str) -> dict[str, tuple[int | None, float]]:
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        head, _, secs = item.partition(":")
        point, _, version = head.partition("@")
        if point not in POINTS:
            raise ValueError(f"{ENV}: unknown point {point!r} (one of {POINTS})")
        out[point] = (int(version) if version else None, float(secs) if secs else 3600.0)
    return out


_HOOKS = _parse(os.environ.get(ENV, ""))
_fired: set[str] = set()


def reached(point: str, version: int | None = None) -> None:
    """Called by the daemon at ``point``; blocks there if a hook for it is set (once per point)."""
    hook = _HOOKS.get(point)
    if hook is None or point in _fired or (hook[0] is not None and hook[0] != version):
        return
    _fired.add(point)
    mark_dir = os.environ.get(ENV_MARK_DIR)
    if mark_dir:
        tmp = Path(mark_dir, f".{point}.tmp")
        tmp.write_text(f"{os.getpid()} {version}\n")
        os.replace(tmp, Path(mark_dir, point))
    log.warning("test hook: holding at %s (version %s) for %.1fs", point, version, hook[1])
    time.sleep(hook[1])
