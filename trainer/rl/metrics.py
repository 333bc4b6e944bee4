"""The thin trainer's metrics: JSON lines, one object per line, each with ``kind`` and ``t`` (``time.time()``).

Kinds (written by rank 0):

* ``start``: the configuration;
* ``step``: one per optimizer step: ``step``, ``version`` (the trainer's, that the staleness is measured
  against), ``reward_mean``, ``reward_std`` (mean within-group std), ``reward_min``/``max``,
  ``zero_std_groups``, ``loss``, the mismatch and correction diagnostics of
  :func:`syncd.trainer.rl.objective.step_diagnostics`
  (``is_mean``, ``is_outside``, ``kl_k3``, ``staleness_mean``/``max``/``counts``, ...), ``tokens`` (trained),
  ``trainer_tokens_per_s`` (trained tokens over the step's compute time), ``rollout_tokens_per_s`` (tokens the
  rollout workers produced since the previous step over the time since), ``wait_s`` (waiting for rollouts),
  ``train_s``, ``buffer``, ``dropped_stale``, ``rollout_failures``, ``refused_groups`` (finished groups the buffer
  refused, by error class: records of a version never published, kept sets that could not be rebuilt);
* ``publish``: ``version``, ``step``, ``stall_s`` (the ``publish()`` call);
* ``engine``: an engine's version changed, as the node daemon's status file says (``engine``, ``version``);
* ``end``: the summary.

:class:`EngineWatcher` polls a daemon status file (``syncd --status-file``; ``{"engines": {name: {"version"}}}``)
and writes ``engine`` lines; :func:`publish_to_serving` pairs ``publish`` and ``engine`` lines into the time from
each ``publish()`` to every engine serving that version (or a newer one).

Thread-safety: :class:`MetricsLog` may be written from any thread.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

__all__ = ["MetricsLog", "EngineWatcher", "read_metrics", "publish_to_serving", "summarize"]


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


class MetricsLog:
    """Appends JSON lines to ``path`` (created with its folder; emptied first with ``truncate``); non-finite floats
    are written as null."""

    def __init__(self, path, *, truncate: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "w" if truncate else "a")
        self._lock = threading.Lock()

    def write(self, kind: str, **fields) -> dict:
        rec = {"kind": kind, "t": time.time(), **_clean(fields)}
        with self._lock:
            if not self._fh.closed:
                self._fh.write(json.dumps(rec, allow_nan=False) + "\n")
                self._fh.flush()
        return rec

    def close(self) -> None:
        with self._lock:
            self._fh.close()


def read_metrics(path) -> list[dict]:
    """Every line of a metrics file (a torn last line, from a run that was killed, is skipped)."""
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


class EngineWatcher:
    """Polls a daemon status file every ``interval_s`` in a thread and logs each engine's version changes."""

    def __init__(self, status_file, metrics: MetricsLog, *, interval_s: float = 0.1):
        self.status_file, self.metrics, self.interval_s = Path(status_file), metrics, interval_s
        self.versions: dict[str, int | None] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-watcher", daemon=True)

    def start(self) -> "EngineWatcher":
        self._thread.start()
        return self

    def poll(self) -> dict[str, int | None]:
        try:
            doc = json.loads(self.status_file.read_text())
        except (OSError, ValueError):
            return dict(self.versions)
        engines = doc.get("engines") if isinstance(doc, dict) else None
        for name, e in (engines or {}).items():
            v = e.get("version") if isinstance(e, dict) else None
            if isinstance(v, int) and self.versions.get(name) != v:
                self.versions[name] = v
                self.metrics.write("engine", engine=str(name), version=v)
        return dict(self.versions)

    def min_version(self) -> int | None:
        vs = [v for v in self.versions.values() if v is not None]
        return min(vs) if vs else None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
            except Exception:  # noqa: BLE001 -- a watcher never dies; the next poll retries
                log.exception("reading the daemon status file %s", self.status_file)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.poll()


def publish_to_serving(lines: list[dict]) -> list[dict]:
    """Per published version: ``{"version", "publish_t", "served_t", "seconds"}``, ``served_t`` the first time
    every engine (every one the lines name) served it or a newer one; versions never served get ``None``."""
    pubs = [ln for ln in lines if ln.get("kind") == "publish"]
    events = sorted((ln for ln in lines if ln.get("kind") == "engine"), key=lambda ln: ln["t"])
    engines = sorted({e["engine"] for e in events})
    out = []
    for p in pubs:
        current = dict.fromkeys(engines)
        served = None
        for e in events:
            current[e["engine"]] = e["version"]
            if e["t"] >= p["t"] - 1e-3 and engines and all(v is not None and v >= p["version"]
                                                          for v in current.values()):
                served = e["t"]
                break
        if served is None and engines and all(v is not None and v >= p["version"] for v in current.values()):
            served = p["t"]  # already there when published (never later than the first check)
        out.append({"version": p["version"], "publish_t": p["t"], "served_t": served,
                    "seconds": None if served is None else max(0.0, served - p["t"])})
    return out


def summarize(lines: list[dict], *, window: int = 3) -> dict:
    """Reward at the start and the end (means over the first and last ``window`` steps), staleness of the
    trained tokens, mismatch, throughput and publish-to-serving times of one run's metrics lines."""
    steps = [ln for ln in lines if ln.get("kind") == "step"]
    if not steps:
        return {"steps": 0}
    rewards = [s["reward_mean"] for s in steps]
    w = max(1, min(window, len(steps) // 2 or 1))
    counts: dict[str, int] = {}
    for s in steps:
        for k, v in (s.get("staleness_counts") or {}).items():
            counts[k] = counts.get(k, 0) + v
    total = sum(counts.values())
    serve = [p["seconds"] for p in publish_to_serving(lines) if p["seconds"] is not None]
    train_s = sum(s.get("train_s") or 0.0 for s in steps)
    tokens = sum(s.get("tokens") or 0 for s in steps)
    wall = steps[-1]["t"] - (next((ln["t"] for ln in lines if ln.get("kind") == "start"), steps[0]["t"]))

    def med(key):
        vals = [s[key] for s in steps if s.get(key) is not None]
        return statistics.median(vals) if vals else None

    return {"steps": len(steps), "reward_first": sum(rewards[:w]) / w, "reward_last": sum(rewards[-w:]) / w,
            "reward_window": w, "tokens_trained": tokens, "wall_s": wall,
            "trained_tokens_per_s": tokens / wall if wall > 0 else None,
            "trainer_tokens_per_s": tokens / train_s if train_s > 0 else None,
            "staleness_counts": dict(sorted(counts.items(), key=lambda kv: int(kv[0]))),
            "staleness_mean": sum(int(k) * v for k, v in counts.items()) / total if total else None,
            "staleness_max": max((int(k) for k in counts), default=None),
            "is_mean_median": med("is_mean"), "is_outside_median": med("is_outside"), "kl_k3_median": med("kl_k3"),
            "publish_to_serving_s_median": statistics.median(serve) if serve else None,
            "versions_published": sum(1 for ln in lines if ln.get("kind") == "publish"),
            "dropped_stale": steps[-1].get("dropped_stale", 0),
            "rollout_failures": steps[-1].get("rollout_failures", {}),
            "refused_groups": steps[-1].get("refused_groups", {})}
