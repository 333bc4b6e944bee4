"""Watch engines from outside: ``python -m bench.netsim watch NAME=URL ... --out FILE [--every-s S]`` asks each
engine's control routes, over and over until SIGTERM, for its state, the checksums of every weight, and its state
again, and appends one JSON line per round and engine to ``FILE``:
``{"t", "engine", "version", "writes", "checksums": {name: int}, "clean"}``.

``clean`` is true when the engine's version and write counter were the same before and after the checksums (no
weight write overlapped them), so those checksums are the weights the engine served at ``version``; the
reader compares them with that version's manifest. An engine that does not answer gives a line with
``"error"`` instead. The watcher takes no lease: it never blocks the daemon that drives the engines.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)


def sample(adapter) -> dict:
    """One clean-or-not reading of ``adapter`` (a :class:`syncd.engines.client.RemoteAdapter`)."""
    before = adapter.state()
    sums = adapter.checksum()
    after = adapter.state()
    same = (before["version"], before["writes"]) == (after["version"], after["writes"])
    return {"version": after["version"], "writes": after["writes"], "checksums": sums, "clean": same}


def watch(engines: dict[str, str], out: Path, every_s: float, stop: threading.Event) -> int:
    """Sample every engine each ``every_s`` seconds until ``stop``; returns the number of lines written."""
    from syncd.engines.client import RemoteAdapter

    adapters = {name: RemoteAdapter(url, timeout_s=10, connect_timeout_s=2) for name, url in engines.items()}
    lines = 0
    with open(out, "a") as fh:
        while not stop.is_set():
            for name, adapter in adapters.items():
                row = {"t": time.time(), "engine": name}
                try:
                    row.update(sample(adapter))
                except Exception as exc:  # noqa: BLE001 -- an engine down or cut off is a reading too
                    row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                fh.write(json.dumps(row) + "\n")
                fh.flush()
                lines += 1
            stop.wait(every_s)
    return lines


def read(path) -> list[dict]:
    """The watcher's lines (a torn last line is left out)."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines(keepends=True) if line.endswith("\n")]


def main(args) -> int:
    engines = dict(e.split("=", 1) for e in args.engines)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    watch(engines, Path(args.out), args.every_s, stop)
    return 0
