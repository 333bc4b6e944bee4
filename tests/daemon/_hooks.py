"""Hold a daemon process at a named point of its update path so that a test can kill it there deterministically:
``python -m tests.daemon._hooks [syncd arguments]`` runs the ``syncd`` command with an observer of
:mod:`syncd.daemon.points` installed.

``SYNCD_TEST_PAUSE_AT=POINT[@VERSION][:SECONDS]`` (comma-separated for several) makes the daemon, on reaching
``POINT`` (for ``VERSION`` only, if given), create the file ``$SYNCD_TEST_MARK_DIR/POINT`` and sleep ``SECONDS``
(default 3600) before going on, once per point. At ``download`` it first leaves half of the shard in the cache's
``tmp/`` (as a crash mid-write would) and removes it after the sleep.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

from syncd.daemon import points

log = logging.getLogger(__name__)
ENV = "SYNCD_TEST_PAUSE_AT"
ENV_MARK_DIR = "SYNCD_TEST_MARK_DIR"


def _parse(text: str) -> dict[str, tuple[int | None, float]]:
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        head, _, secs = item.partition(":")
        point, _, version = head.partition("@")
        if point not in points.POINTS:
            raise ValueError(f"{ENV}: unknown point {point!r} (one of {points.POINTS})")
        out[point] = (int(version) if version else None, float(secs) if secs else 3600.0)
    return out


class Hold:
    """The observer: holds the daemon at the points of ``spec`` (the ``SYNCD_TEST_PAUSE_AT`` form)."""

    def __init__(self, spec: str, mark_dir: str | None):
        self.hooks, self.mark_dir, self.fired = _parse(spec), mark_dir, set()

    def __call__(self, point: str, version: int | None = None, **context) -> None:
        hook = self.hooks.get(point)
        if hook is None or point in self.fired or (hook[0] is not None and hook[0] != version):
            return
        self.fired.add(point)
        tmp = None
        if point == "download":  # half a shard in tmp/, as a crash mid-write would leave it
            cache, data = context["cache"], context["data"]
            fd, tmp = cache.temp_file(context["sha256"][:16])
            with os.fdopen(fd, "wb") as fh:
                fh.write(memoryview(data)[: len(data) // 2])
        if self.mark_dir:
            mark = Path(self.mark_dir, f".{point}.tmp")
            mark.write_text(f"{os.getpid()} {version}\n")
            os.replace(mark, Path(self.mark_dir, point))
        log.warning("test hook: holding at %s (version %s) for %.1fs", point, version, hook[1])
        time.sleep(hook[1])
        if tmp is not None:
            os.unlink(tmp)


def main(argv=None) -> int:
    spec = os.environ.get(ENV, "")
    if spec:
        points.install(Hold(spec, os.environ.get(ENV_MARK_DIR)))
    from syncd.app.cli import main as cli

    return cli(argv)


if __name__ == "__main__":
    sys.exit(main())
