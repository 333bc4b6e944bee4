"""Holding a Dynamo worker's stream at a chosen point, so that a test can stop or kill the worker in the middle of
it: a worker makes thousands of tokens a second on a quiet machine and far fewer on a busy one, and a starved
client reads them late. Two ways, both letting the worker generate only in short steps until the client has seen
enough:

* paused through its admin routes (:func:`in_steps`; :func:`holder` finds the worker that holds the request). A
  pause that reaches a worker streaming on a busy machine can take seconds to land (17 s was seen), and the worker
  generates meanwhile;
* its engine processes stopped with SIGSTOP (:func:`frozen_steps`, :func:`engine_processes`): for a worker whose
  engine runs in processes of its own (vLLM). Beside busy loops a step still lasted 0.17-0.53 s rather than
  50 ms, and in 4 of 14 runs vLLM made a whole stream before the client had seen 32 tokens (not understood;
  docs/dynamo.md)."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import time
from urllib.parse import urlsplit


def holder(workers: dict) -> str | None:
    """The instance id of the worker (``{instance_id: node.workers() entry}``) whose generate endpoint holds a
    request (its in-flight gauge, Dynamo's ``/metrics`` on the worker's system port), or None."""
    from syncd import http_client

    for wid, w in workers.items():
        text = http_client.request("GET", w["admin_url"], "/metrics", timeout_s=30).body.decode(errors="replace")
        for line in text.splitlines():
            if (line.startswith("dynamo_component_inflight_requests{") and 'dynamo_endpoint="generate"' in line
                    and float(line.rsplit(" ", 1)[1]) > 0):
                return wid
    return None


def step(engine) -> None:
    """Resume the paused ``engine`` (a ``RemoteAdapter`` holding its lease) with a pause sent right behind the
    resume (once the resume is on the wire): a pause that reaches a worker streaming its tokens took seconds on a
    busy machine, one the worker serves as the resume ends does not. The worker does not always serve them in that
    order (the first pause is then a no-op); a second pause makes sure of it, at once where the first one held."""
    u = urlsplit(engine.base_url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    try:
        conn.request("POST", "/engine/weights/resume", body=json.dumps(engine.credentials()),
                     headers={"Content-Type": "application/json"})
        engine.pause()
        reply = conn.getresponse()
        assert reply.status == 200, reply.read()[:300]
    finally:
        conn.close()
    engine.pause()


def in_steps(engine, seen, enough: int, alive, timeout_s: float = 240.0) -> int:
    """Let the paused ``engine`` generate in steps (:func:`step`) until the client has ``enough`` events
    (``seen()``) once it has caught up with the engine (no new event for five times as long as the step took, at
    least 50 ms); returns with it paused and the events seen. A step lets the engine make only what it makes
    between a resume and a pause, however late its events reach the client. Stops early once ``alive()`` is
    false (the stream ended)."""
    deadline = time.monotonic() + timeout_s
    while True:
        t = time.monotonic()
        step(engine)
        quiet = max(0.05, 5 * (time.monotonic() - t))
        last, since = seen(), time.monotonic()
        while time.monotonic() - since < quiet:
            time.sleep(quiet / 20)
            if seen() != last:
                last, since = seen(), time.monotonic()
        if last >= enough or not alive():
            return last
        assert time.monotonic() < deadline, f"{last} events {timeout_s:.0f} s into the stream"


def process_stat(pid: int) -> tuple[str, str, int] | None:
    """``(command name, state, process group)`` of ``pid`` from ``/proc/<pid>/stat``, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    state, _ppid, pgrp = stat.rsplit(")", 1)[1].split()[:3]  # the command may hold spaces and parentheses
    return stat[stat.index("(") + 1:stat.rindex(")")], state, int(pgrp)


def engine_processes(worker_pid: int) -> list[int]:
    """The pids of a Dynamo worker's engine processes: every other member of its process group (the node runs each
    worker in a session of its own), for a vLLM worker its EngineCore and vLLM worker processes."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != worker_pid:
            st = process_stat(int(entry))
            if st is not None and st[2] == worker_pid:
                pids.append(int(entry))
    return pids


def signal_all(pids, sig: int) -> None:
    """Send ``sig`` to each of ``pids`` that still exists."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def frozen_steps(pids, seen, enough: int, alive, *, step_s: float = 0.05, timeout_s: float = 240.0) -> int:
    """With the engine processes ``pids`` stopped (SIGSTOP), let them run ``step_s`` at a time (SIGCONT, sleep,
    SIGSTOP, from a process at nice -20) until the client has seen ``enough`` (``seen()``: events, tokens) once it
    has caught up (nothing new for a quiet window); returns with them stopped and what was seen. The engines make
    tokens only while they run, however slowly the machine serves the client or an admin route. The window is
    0.2 s and doubles, up to 5 s, after every step that brought the client nothing: on a busy machine a stream's
    first events reached the client seconds late (4.4 s was seen). Stops early once ``alive()`` is false (the
    stream ended)."""
    deadline = time.monotonic() + timeout_s
    quiet, before = 0.2, seen()
    ids = " ".join(str(p) for p in pids)
    while True:
        # the step runs in a process of its own at the highest priority, not in a thread of the busy test process
        # (which wakes from its sleep only once it has the GIL and a core)
        subprocess.run(["nice", "-n", "-20", "bash", "-c", f"kill -CONT {ids} 2>/dev/null; sleep {step_s}; "
                        f"kill -STOP {ids} 2>/dev/null; exit 0"], timeout=60, check=True, stderr=subprocess.DEVNULL)
        last, since = seen(), time.monotonic()
        while time.monotonic() - since < quiet:
            time.sleep(0.01)
            if seen() != last:
                last, since = seen(), time.monotonic()
        if last >= enough or not alive():
            return last
        quiet, before = (0.2 if last > before else min(5.0, 2 * quiet)), last
        assert time.monotonic() < deadline, f"{last} seen {timeout_s:.0f} s into the stream"
