"""What a cluster node keeps beside its cache: the version it last delivered (:class:`DeliveredRecord`,
``<cache_root>/cluster/state.json``, so a restart neither repeats nor skips a version) and its event log
(:class:`EventLog`, JSON lines for tests and benchmarks)."""

from __future__ import annotations

import json
import logging
import os
import time

from syncd import manifest as mf
from syncd.cluster import wire
from syncd.cluster.errors import ProtocolError

log = logging.getLogger("syncd.cluster.node")

__all__ = ["DeliveredRecord", "EventLog"]


class EventLog:
    """Appends one JSON object per line to a file (for tests and benchmarks); no-op without a path."""

    def __init__(self, path=None):
        self._fh = open(path, "a", buffering=1) if path else None

    def __call__(self, ev: str, **kw) -> None:
        if self._fh is not None:
            self._fh.write(json.dumps({"ev": ev, "t": time.time(), **kw}, default=str) + "\n")

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()


class DeliveredRecord:
    """``{"run_id", "delivered"}`` at ``path``: read bounded and strictly (:func:`syncd.cluster.wire.parse_json`),
    written atomically."""

    def __init__(self, path: str, run_id: str):
        self.path, self.run_id = path, run_id

    def load(self) -> int | None:
        """The version recorded for this run, or None (no file, another run's, or unreadable: logged)."""
        try:
            with open(self.path, "rb") as fh:
                raw = fh.read(4097)
            doc = wire.parse_json(raw, self.path, max_bytes=4096)
        except FileNotFoundError:
            return None
        except (OSError, ProtocolError) as exc:
            log.warning("ignoring the cluster state file: %s", exc)
            return None
        v = doc.get("delivered")
        if (doc.get("run_id") == self.run_id and isinstance(v, int) and not isinstance(v, bool)
                and 0 <= v <= mf.MAX_VERSION):
            return v
        return None

    def save(self, delivered: int | None) -> None:
        """Record ``delivered`` (atomically: a temp file, then ``os.replace``). Raises ``OSError``."""
        tmp = self.path + ".tmp"
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(tmp, "w") as fh:
            json.dump({"run_id": self.run_id, "delivered": delivered}, fh)
        os.replace(tmp, self.path)
