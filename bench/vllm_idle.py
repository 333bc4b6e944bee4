"""``python -m bench.vllm_idle``: what the node daemon's scrubs cost an idle vLLM engine's host, against no calls.

A scrub checksums a slice of an engine's weights through the engine (``VLLMEngine.checksum``: a ``collective_rpc``
into vLLM's worker process). After every call that reaches it, vLLM's worker busy-polls its shared-memory message
queue for ``busy_loop_s`` (1 s in vLLM 0.32: ``SpinCondition`` in ``vllm/distributed/device_communicators/
shm_broadcast.py``) before it sleeps on its socket. This routine starts a real vLLM (CPU build, a tiny Qwen2 made
locally), leaves it idle, and for each period P of ``--periods`` calls ``checksum`` on a few parameters every P
seconds for ``--window`` seconds, reading the CPU time of every process of the engine (this one and its children,
from ``/proc``). The baseline is the same window with no calls. The limit it is compared with: the spin alone
would cost ``min(1, busy_loop_s / P)`` of a core. Fields: ``rows[]`` with ``period_s`` (None: no calls),
``cores`` (CPU seconds per second of the window), ``spin_limit`` (the spin's share, None for the baseline).

Measured here (2 cores, idle machine, P = 0.5, 1, 2, 5, 10 s): 1.00, 1.00, 0.50, 0.20 and 0.11 cores, 0.01 without
calls; the daemon therefore scrubs every ``--engine-scrub-s`` (10 s), not at every engine check (1 s).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from bench._report import Row, finish, output_flags

__all__ = ["main", "parser", "process_tree_cpu_s"]

#: vLLM 0.32's busy-poll after each read of its message queue (``SpinCondition(busy_loop_s=1)``), seconds
BUSY_LOOP_S = 1.0


def process_tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by ``pid`` and every live descendant, from ``/proc``; processes that
    vanish while it reads are skipped."""
    tick = os.sysconf("SC_CLK_TCK")
    total, todo, seen = 0.0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            continue
    return total


def measure(engine, period_s: float | None, window_s: float, names: list[str]) -> float:
    """Cores the engine's processes use over ``window_s`` seconds while ``names`` are checksummed through it every
    ``period_s`` seconds (None: never)."""
    me = os.getpid()
    c0, t0 = process_tree_cpu_s(me), time.monotonic()
    while time.monotonic() - t0 < window_s:
        if period_s is None:
            time.sleep(min(0.5, window_s))
            continue
        engine.checksum(names)
        time.sleep(period_s)
    return (process_tree_cpu_s(me) - c0) / (time.monotonic() - t0)


def run(periods: list[float], window_s: float, settle_s: float, workdir: Path) -> list[dict]:
    """Start a tiny vLLM in ``workdir``, then the baseline window and one window per period (each after
    ``settle_s`` seconds without calls, so that the last call's spin has ended)."""
    from syncd.engine.reference.make_tiny import write_model
    from syncd.engine.vllm import VLLMEngine

    model = write_model(workdir / "model", arch="qwen2", seed=5, hidden=128, heads=2, kv_heads=1, intermediate=256)
    engine = VLLMEngine(model, version=0)
    try:
        names = [p.name for p in engine.parameters()][:4]
        rows = []
        for period in [None, *periods]:
            time.sleep(settle_s)
            cores = measure(engine, period, window_s, names)
            rows.append({"period_s": period, "cores": cores,
                         "spin_limit": None if period is None else min(1.0, BUSY_LOOP_S / period)})
            print(f"  {'no calls' if period is None else f'a call every {period:g} s'}: {cores:.2f} cores"
                  + ("" if period is None else f" (the spin alone: {rows[-1]['spin_limit']:.2f})"), flush=True)
        return rows
    finally:
        engine.close()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.vllm_idle", description=__doc__.split("\n\n")[0])
    p.add_argument("--periods", default="0.5,1,2,5,10", help="seconds between calls, comma-separated")
    p.add_argument("--window", type=float, default=20.0, help="seconds measured per period")
    p.add_argument("--settle", type=float, default=3.0, help="seconds without calls before each window")
    output_flags(p, "vllm_idle")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        periods = [float(x) for x in args.periods.split(",")]
    except ValueError:
        print(f"vllm_idle: --periods must be numbers separated by commas, got {args.periods!r}", file=sys.stderr)
        return 2
    if not all(p > 0 for p in periods) or args.window <= 0 or args.settle < 0:
        print("vllm_idle: --periods and --window must be positive, --settle not negative", file=sys.stderr)
        return 2
    print(f"vLLM idle cost of calls into it: {args.window:g} s per period, cores this process tree used")
    with tempfile.TemporaryDirectory(prefix="syncd-vllm-idle-") as tmp:
        rows = run(periods, args.window, args.settle, Path(tmp))
    base = rows[0]["cores"]
    table = [Row("idle, no calls", None, None, "", f"{base:.2f} cores")]
    table += [Row(f"a call every {r['period_s']:g} s", None, r["cores"] / r["spin_limit"],
                  "the spin alone (busy_loop_s / period)", f"{r['cores']:.2f} cores") for r in rows[1:]]
    out = {"bench": "vllm_idle", "window_s": args.window, "busy_loop_s": BUSY_LOOP_S, "rows": rows}
    return finish("vllm_idle", args, out, table)


if __name__ == "__main__":
    sys.exit(main())
