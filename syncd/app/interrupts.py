"""Ctrl-C for the demos: one interrupt, or several, at any point stops every process the demo started and ends it
with a one-line message instead of a traceback.

The demos start each child in a session of its own (``start_new_session=True``), so a child leads a process group
holding whatever it starts in turn (trainer ranks, vLLM's engine core) and a terminal's Ctrl-C reaches the demo
alone. Inside ``with Interrupts() as interrupts:`` the first SIGINT or SIGTERM raises ``KeyboardInterrupt`` in the
main thread, wherever it is, so the demo's ``finally`` blocks stop what they started, as on any other failure;
later signals never raise (a cleanup is never cut short) but SIGKILL every watched process group at once, so that a
second Ctrl-C ends a slow shutdown. After the interrupt the demo calls :meth:`Interrupts.stop_all` (what the cleanup
missed) and :meth:`Interrupts.report`, which prints ``interrupted; stopped N processes`` and returns the exit status
(128 + the signal: 130 for Ctrl-C). Stopped are the watched processes and every other child of this process (found
in ``/proc``: a child whose ``Popen`` the interrupt cut short is never lost). After an interrupt, leaving the
``with`` block ignores SIGINT and SIGTERM: the process is exiting, and Python's own shutdown would otherwise let a
last Ctrl-C kill it half-way.

Main thread only (signal handlers are); the sources given to :meth:`Interrupts.watch` are called from the handler
and must not block.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Callable, Iterable

__all__ = ["Interrupts"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupts:
    """See the module docstring. ``signum``: the first signal received (None: none yet)."""

    def __init__(self):
        self._sources: list[Callable[[], Iterable[subprocess.Popen | None]]] = []
        self._previous: dict = {}
        self.signum: int | None = None
        self.running_at_interrupt = 0

    def __enter__(self) -> "Interrupts":
        for sig in _SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if self.signum is None else signal.SIG_IGN)

    def watch(self, source: Callable[[], Iterable[subprocess.Popen | None]]) -> None:
        """Add ``source()``: the processes (or None) it returns at the moment of asking are stopped on interrupt."""
        self._sources.append(source)

    def processes(self) -> list[subprocess.Popen]:
        """Every watched process started so far (running or not), each once."""
        seen: dict[int, subprocess.Popen] = {}
        for source in self._sources:
            try:
                for p in source() or ():
                    if p is not None:
                        seen.setdefault(p.pid, p)
            except Exception:  # noqa: BLE001 -- a half-built owner answers what it can
                continue
        return list(seen.values())

    def _running(self) -> set[int]:
        return {p.pid for p in self.processes() if p.poll() is None} | set(_children())

    def _on_signal(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum
            self.running_at_interrupt = len(self._running())
            raise KeyboardInterrupt
        self.stop_all()  # again: no more waiting for a graceful shutdown

    def stop_all(self) -> None:
        """SIGKILL the process group of every watched process and every other child (each leads its own group;
        a child in this process's group is killed alone) and reap them."""
        procs = self.processes()
        known = {p.pid for p in procs}
        others = [pid for pid in _children() if pid not in known]
        own_group = os.getpgrp()
        for pid in known | set(others):
            try:
                if os.getpgid(pid) == pid != own_group:
                    os.killpg(pid, signal.SIGKILL)
                else:
                    os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for pid in others:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass

    def report(self) -> int:
        """Print ``interrupted; stopped N processes`` (N: those running when the first signal came) to stderr and
        return the exit status, 128 + the signal."""
        n = self.running_at_interrupt
        print(f"interrupted; stopped {n} process{'' if n == 1 else 'es'}", file=sys.stderr, flush=True)
        return 128 + int(self.signum or signal.SIGINT)


def _children() -> list[int]:
    """The pids of this process's live children (Linux: ``/proc``; elsewhere none)."""
    me, out = os.getpid(), []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                state, ppid = fh.read().rsplit(b")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue
        if int(ppid) == me and state != b"Z":
            out.append(int(name))
    return out
