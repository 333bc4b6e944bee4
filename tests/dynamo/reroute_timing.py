"""How soon after SIGTERM a stopping Dynamo worker gets no more new requests: the numbers ``docs/dynamo.md`` states.

``python -m tests.dynamo.reroute_timing [--runs 5]`` starts a node (frontend, two reference-engine workers on a
tiny model, file discovery, ``syncd.engine.dynamo.serve.Node``). Per run: a long stream keeps one worker busy (a
stopping worker drains it, so it stays alive and listening); two clients send short requests back to back, and
note which worker serves each; after 0.5 s the worker serving the stream gets SIGTERM. A run reports when the
worker's discovery entry (its file under ``<file_kv>/v1/instances``) was gone, polled every 0.2 ms, and how many
of the requests sent after the signal still reached the stopping worker (before it, about half do: the frontend
routes round-robin). The supervisor restarts the worker before the next run; the medians are printed at the end.
Not collected by pytest: ``tests/dynamo/test_cluster.py::test_sigterm_leaves_discovery_at_once_and_drains`` checks
a loose bound (5 s) that holds on a busy machine."""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from syncd.procs import wait_until
from syncd.engine.dynamo.node import Node, NodeConfig
from syncd.engine.dynamo.settings import DynamoSettings
from tests.dynamo._client import post_json, post_stream

SHORT = {"prompt": "x", "max_tokens": 2, "nvext": {"extra_fields": ["worker_id"]}}


def _worker_id(reply: dict) -> int:
    return reply["nvext"]["worker_id"]["decode_worker_id"]


def one_run(node: Node, model: str, *, senders: int = 2, before_s: float = 0.5, after_s: float = 2.0) -> dict:
    """One SIGTERM under steady traffic (see the module docstring): ``gone_ms`` (the worker's discovery entry
    removed), ``first_ms`` (the first request sent after the signal), ``last_ms`` (the last one the stopping worker
    served, None if none), ``requests``/``to_stopping`` (sent after the signal / of those served by it),
    ``before``/``before_to_stopping`` (the same in the ``before_s`` before it)."""
    frontend = node.frontend_url
    stopped: dict = {}
    ready = threading.Event()

    def on_event(i, ev):
        if i == 5 and not stopped:
            stopped.update(next(w for w in node.workers() if w["instance_id"] == _worker_id(ev)))
            ready.set()

    body = {"model": model, "prompt": "a long story:", "max_tokens": 3000, "ignore_eos": True, "temperature": 1.0,
            "nvext": {"extra_fields": ["worker_id"]}}
    stream = threading.Thread(target=post_stream, args=(f"{frontend}/v1/completions", body),
                              kwargs={"on_event": on_event, "timeout": 300})
    stream.start()
    if not ready.wait(60):
        raise RuntimeError("the long stream did not start")
    sent: list = []  # (time.monotonic() the request was sent at, the worker that served it)
    failed: list = []
    end = threading.Event()

    def send():
        while not end.is_set():
            at = time.monotonic()
            status, _, reply = post_json(f"{frontend}/v1/completions", {"model": model, **SHORT})
            if status != 200:
                failed.append((status, reply))
            else:
                sent.append((at, _worker_id(reply)))

    threads = [threading.Thread(target=send) for _ in range(senders)]
    for t in threads:
        t.start()
    time.sleep(before_s)  # steady traffic to both workers first
    entry = _discovery_entry(node, stopped["instance_id"])
    if not entry.exists():
        raise RuntimeError(f"no discovery entry {entry} for the worker to stop")
    t0 = time.monotonic()
    os.kill(stopped["pid"], signal.SIGTERM)
    while entry.exists() and time.monotonic() - t0 < after_s:
        time.sleep(0.0002)  # the entry's removal, to a fraction of a millisecond (a sleep: the senders need the GIL)
    gone = time.monotonic() - t0
    time.sleep(max(0.0, after_s - gone))
    end.set()
    for t in threads:
        t.join(60)
    if failed:
        raise RuntimeError(f"requests failed while a worker stopped: {failed[:3]}")
    after = sorted((at - t0, w) for at, w in sent if at >= t0)
    mine = [at for at, w in after if w == stopped["instance_id"]]
    if not after or (mine and mine[-1] == after[-1][0]):
        raise RuntimeError(f"the stopping worker still got requests {after_s} s after SIGTERM")
    stream.join(300)
    wait_until(lambda: _restarted(node, stopped), 120, f"{stopped['name']} to be restarted and serving")
    before = [w for at, w in sent if at < t0]
    return {"gone_ms": gone * 1000, "first_ms": after[0][0] * 1000, "last_ms": mine[-1] * 1000 if mine else None,
            "requests": len(after), "to_stopping": len(mine), "before": len(before),
            "before_to_stopping": before.count(stopped["instance_id"])}


def _discovery_entry(node: Node, instance_id: int) -> Path:
    """The file through which a worker is listed (file discovery: ``<file_kv>/v1/instances/<ns>%2F...%2F<id hex>``)."""
    (entry,) = Path(node.settings.file_kv, "v1", "instances").glob(f"{node.settings.namespace}%2F*%2F{instance_id:x}")
    return entry


def _restarted(node: Node, stopped: dict) -> bool:
    w = next(w for w in node.workers() if w["name"] == stopped["name"])
    return w["restarts"] > stopped["restarts"] and node.serving()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.dynamo.reroute_timing", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args(argv)
    if args.runs < 1:
        print("reroute_timing: --runs must be at least 1", file=sys.stderr)
        return 2
    from syncd.engine.reference.make_tiny import write_model

    runs = []
    with tempfile.TemporaryDirectory(prefix="reroute-") as tmp:
        root = Path(tmp)
        settings = DynamoSettings(file_kv=root / "kv", namespace=f"r{uuid.uuid4().hex[:8]}")
        cfg = NodeConfig(model=write_model(root / "tiny", arch="qwen2", seed=3), run_dir=root / "node", workers=2,
                         frontend=True, settings=settings,
                         worker_args=("--weights-version", "0", "--drain-timeout", "60"),
                         restart_limit=2 * args.runs + 2, startup_timeout_s=240, managed=False)
        node = Node(cfg).start()
        node.supervise(background=True)
        try:
            for i in range(args.runs):
                r = one_run(node, cfg.model_name)
                runs.append(r)
                last = "none" if r["last_ms"] is None else f"the last one sent {r['last_ms']:.1f} ms after it"
                print(f"run {i + 1}: discovery entry gone {r['gone_ms']:.1f} ms after SIGTERM; "
                      f"{r['to_stopping']} of {r['requests']} requests sent after the signal (the first "
                      f"{r['first_ms']:.1f} ms after it) reached the stopping worker ({last}); "
                      f"{r['before_to_stopping']} of {r['before']} did in the 0.5 s before", flush=True)
        finally:
            node.close()
    gone = [r["gone_ms"] for r in runs]
    late = [r["last_ms"] for r in runs if r["last_ms"] is not None]
    print(f"{len(runs)} runs: discovery entry gone a median {statistics.median(gone):.1f} ms after SIGTERM "
          f"({min(gone):.1f}-{max(gone):.1f} ms); {sum(r['to_stopping'] for r in runs)} of "
          f"{sum(r['requests'] for r in runs)} requests sent after the signal reached the stopping worker"
          + (f", the last {max(late):.1f} ms after it" if late else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
