"""Running one native op over many tensors on every core: wide tensors one after another with all threads,
the rest concurrently with one thread each (the native code releases the GIL). Shared by ``encode_many``,
``apply_many`` and ``checksum_many``. Thread-safe."""

from __future__ import annotations

import threading

from syncd.ops import _backend


def run_many(fn, items: list, sizes: list[int], block_log2: int) -> list:
    """Run ``fn(item, threads)`` over ``items``: tensors of many blocks (at least 4 per thread) one after
    another with every thread, the rest concurrently with one thread each, which balances the cores better
    than splitting a two-block tensor two ways (the native code releases the GIL)."""
    total = _backend.threads()
    wide = 4 * total << block_log2
    big = [i for i, n in enumerate(sizes) if n >= wide]
    small = [i for i, n in enumerate(sizes) if n < wide]
    out: list = [None] * len(items)
    for i in big:
        out[i] = fn(items[i], total)
    if small:
        small.sort(key=lambda i: -sizes[i])  # largest first: the tail of the pool stays short
        for i, r in zip(small, _executor(total).map(lambda i: fn(items[i], 1), small)):
            out[i] = r
    return out


_EXECUTORS: dict = {}
_EXECUTORS_LOCK = threading.Lock()


def _executor(workers: int):
    """A process-wide pool of ``workers`` threads (created once; map calls may overlap)."""
    with _EXECUTORS_LOCK:
        pool = _EXECUTORS.get(workers)
        if pool is None:
            from concurrent.futures import ThreadPoolExecutor

            pool = _EXECUTORS[workers] = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="syncd-ops")
        return pool
