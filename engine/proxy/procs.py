"""Starting a sandbox proxy process (``python -m syncd.engine.proxy``) and waiting until it serves: what the RL stack,
the rollout benchmark and the tests do to put one in front of a Dynamo frontend."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from syncd.procs import stop_process, wait_until

__all__ = ["start_proxy"]


def start_proxy(workdir: str | Path, upstream: str, store_url: str, run_id: str, sandbox_id: str, *extra: str,
                env: dict | None = None, log_path: str | Path | None = None,
                timeout_s: float = 60.0) -> tuple[subprocess.Popen, str]:
    """Start ``python -m syncd.engine.proxy`` for ``sandbox_id`` of run ``run_id`` in front of the frontend at
    ``upstream``, recording to ``store_url`` (``extra``: more of its flags; ``env``: its environment), its log in
    ``log_path`` (default ``<workdir>/proxy-<sandbox>.log``); returns ``(process, its URL)`` once it serves, in
    its own session (a ready file an earlier proxy left in ``workdir`` is removed first, and the file must name this
process). Raises ``RuntimeError`` (with the log's tail) when it exits, ``TimeoutError`` when it does not
    serve within ``timeout_s``; it is stopped then."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    ready = workdir / f"proxy-{sandbox_id}.json"
    log = Path(log_path) if log_path is not None else workdir / f"proxy-{sandbox_id}.log"
    ready.unlink(missing_ok=True)  # a reused workdir: an earlier proxy's file must not answer for this one
    with open(log, "ab") as logf:
        proc = subprocess.Popen([sys.executable, "-m", "syncd.engine.proxy", "--upstream", upstream, "--store", store_url,
                                 "--run-id", run_id, "--sandbox-id", sandbox_id, "--ready-file", str(ready),
                                 "--log-level", "INFO", *extra],
                                env=env, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        url = wait_until(lambda: _ready(ready, proc.pid), timeout_s, f"proxy {sandbox_id} to serve",
                         alive=lambda: proc.poll() is not None and f"exited: {log.read_text()[-2000:]}")
    except BaseException:
        stop_process(proc, 5)
        raise
    return proc, url


def _ready(path: Path, pid: int) -> str | None:
    """The URL in the ready file ``path`` once the proxy of ``pid`` wrote it (written by an atomic rename)."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    return doc["url"] if doc.get("pid") == pid else None
