"""Holding a Dynamo worker's stream at a chosen point, so that a test can stop or kill the worker in the middle of
it: a worker makes thousands of tokens a second on a quiet machine and far fewer on a busy one, and a starved
client reads them late. The worker is paused through its admin routes and let generate only in short steps
(:func:`in_steps`; :func:`holder` finds the worker that holds the request) until the client has seen enough.

For an engine that runs inside the worker process (the reference engine). A pause that reaches a vLLM worker
streaming on a busy machine took seconds to land (17 s was seen) while vLLM generated on: vLLM is paced instead
(``tests/dynamo/_paced_vllm.py``)."""

from __future__ import annotations

import http.client
import json
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
