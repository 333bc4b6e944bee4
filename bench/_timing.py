"""The benchmarks' one timer. Machines are noisy (two shared cores): quote medians, and ratios of runs made back to
back, which move together when a neighbour takes the CPU.

* :func:`median_time` / :func:`times`: seconds of ``fn()`` over ``repeats`` calls, after ``warmup`` untimed calls,
  with an untimed ``setup()`` before each; ``sync`` (e.g. ``torch.cuda.synchronize``) is called before the clock
  starts and before it stops, so device work is inside the measurement;
* :func:`best_time`: the shortest of those (a bandwidth ceiling);
* :func:`paired`: ``fn`` and a baseline back to back in each round: the median of ``fn`` and the median of the
  per-round ratios baseline / ``fn`` (:func:`paired_rounds`: every round's);
* :func:`cuda_time`: median seconds between two CUDA events around ``fn`` (its host work included);
* :func:`device_copy`: :func:`cuda_time` of a device copy of a tensor, the GPU benchmarks' yardstick
  (:func:`have_cuda`: whether there is a GPU to time, said when not);
* :func:`time_and_peak`: median seconds and the peak resident memory above the start (Linux ``/proc``);
* :class:`Stopwatch`: elapsed seconds of the phases of a longer run (``lap()``).
"""

from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path
from typing import Callable

__all__ = ["median_time", "times", "best_time", "paired", "paired_rounds", "cuda_time", "have_cuda", "device_copy", "time_and_peak", "Stopwatch", "median"]

clock = time.perf_counter


def median(xs) -> float:
    """The median of ``xs`` (NaN when there are none)."""
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def times(fn: Callable[[], object], repeats: int, *, setup: Callable[[], object] | None = None, warmup: int = 0,
          sync: Callable[[], object] | None = None) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn`` (see the module docstring)."""
    out = []
    for i in range(warmup + repeats):
        if setup is not None:
            setup()
        if sync is not None:
            sync()
        t0 = clock()
        fn()
        if sync is not None:
            sync()
        if i >= warmup:
            out.append(clock() - t0)
    return out


def median_time(fn: Callable[[], object], repeats: int, **kw) -> float:
    """Median seconds of ``fn`` (:func:`times`' keywords)."""
    return statistics.median(times(fn, repeats, **kw))


def best_time(fn: Callable[[], object], repeats: int, **kw) -> float:
    """Shortest seconds of ``fn`` (:func:`times`' keywords)."""
    return min(times(fn, repeats, **kw))


def paired(fn: Callable[[], object], base: Callable[[], object], repeats: int, *,
           warmup: int = 1) -> tuple[float, float]:
    """``(median seconds of fn, median over rounds of base seconds / fn seconds)``, ``base`` run right before
    ``fn`` in every round."""
    ts, _, ratios = paired_rounds(fn, base, repeats, warmup=warmup)
    return statistics.median(ts), statistics.median(ratios)


def paired_rounds(fn: Callable[[], object], base: Callable[[], object], repeats: int, *,
                  warmup: int = 0) -> tuple[list[float], list[float], list[float]]:
    """:func:`paired`'s rounds, each: (seconds of ``fn``, seconds of ``base`` run right before it, base / fn)."""
    for _ in range(warmup):
        fn()
        base()
    ts, base_ts, ratios = [], [], []
    for _ in range(repeats):
        t0 = clock()
        base()
        t1 = clock()
        fn()
        t2 = clock()
        ts.append(t2 - t1)
        base_ts.append(t1 - t0)
        ratios.append((t1 - t0) / (t2 - t1))
    return ts, base_ts, ratios


def cuda_time(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``fn`` measured with CUDA events (host work inside ``fn`` is included), after one
    untimed call."""
    import torch

    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts)


def have_cuda() -> bool:
    """Whether a CUDA GPU is there to time; prints that there is nothing to time when not."""
    import torch

    if torch.cuda.is_available():
        return True
    print("no CUDA GPU: nothing to time")
    return False


def device_copy(x, repeats: int) -> tuple[float, float]:
    """(median seconds, GB/s read + write) of a device copy of tensor ``x`` (:func:`cuda_time`)."""
    nbytes = x.numel() * x.element_size()
    copy_s = cuda_time(lambda: x.clone(), repeats)
    return copy_s, 2 * nbytes / copy_s / 1e9


def _rss() -> tuple[int, int]:
    """(current RSS, peak RSS since the last reset) in bytes."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def time_and_peak(fn: Callable[[], object], repeats: int) -> tuple[float, int]:
    """(median seconds, peak RSS above the starting point in bytes) of ``fn()``; the peak of the first call."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS counter
    base, _ = _rss()
    ts = []
    for i in range(repeats):
        t0 = clock()
        fn()
        ts.append(clock() - t0)
        if i == 0:
            peak = _rss()[1] - base
    return statistics.median(ts), peak


class Stopwatch:
    """Seconds since it was made (:attr:`elapsed`) and since the last :meth:`lap`."""

    def __init__(self):
        self.start = self._last = clock()

    @property
    def elapsed(self) -> float:
        return clock() - self.start

    def lap(self) -> float:
        """Seconds since the previous lap (or the start); starts the next one."""
        now = clock()
        dt, self._last = now - self._last, now
        return dt
