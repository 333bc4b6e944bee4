"""Real Dynamo clusters for the tests: a tiny reference-engine model, a node (frontend + workers, started
by ``engine.dynamo.serve.Node``) and per-sandbox proxies (``python -m engine.proxy`` processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from engine.dynamo.procs import stop_process, wait_until

RUN_ID = "dyn-run"


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    from engine.reference.make_tiny import write_model

    return write_model(tmp_path_factory.mktemp("dyn-model") / "tiny", arch="qwen2", seed=3)


@dataclass
class ProxyProcess:
    """A running ``python -m engine.proxy``; :meth:`stop` sends SIGTERM (open trajectories get written)."""

    proc: subprocess.Popen
    url: str
    log: Path

    def stop(self) -> int | None:
        return stop_process(self.proc, 30)


def start_proxy(workdir: Path, upstream: str, store_url: str, sandbox_id: str, *extra: str) -> ProxyProcess:
    workdir.mkdir(parents=True, exist_ok=True)
    ready = workdir / f"proxy-{sandbox_id}.json"
    log = workdir / f"proxy-{sandbox_id}.log"
    with open(log, "ab") as logf:
        proc = subprocess.Popen([sys.executable, "-m", "engine.proxy", "--upstream", upstream, "--store", store_url,
                                 "--run-id", RUN_ID, "--sandbox-id", sandbox_id, "--ready-file", str(ready),
                                 "--log-level", "INFO", *extra],
                                stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        wait_until(ready.exists, 60, f"proxy {sandbox_id} to serve",
                   alive=lambda: proc.poll() is not None and f"exited: {log.read_text()[-2000:]}")
    except BaseException:
        stop_process(proc, 5)
        raise
    return ProxyProcess(proc, json.loads(ready.read_text())["url"], log)


@pytest.fixture
def dynamo_env_clean(monkeypatch):
    """Tests that build Dynamo settings must not inherit a developer's DYN_* variables."""
    for var in list(os.environ):
        if var.startswith("DYN_") or var in ("ETCD_ENDPOINTS", "NATS_SERVER"):
            monkeypatch.delenv(var)
