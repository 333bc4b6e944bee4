"""Real Dynamo clusters for the tests: a tiny reference-engine model, a node (frontend + workers, started
by ``syncd.engine.dynamo.serve.Node``) and per-sandbox proxies (``python -m syncd.engine.proxy`` processes)."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from syncd.procs import stop_process
from syncd.engine.proxy import procs as proxy_procs

RUN_ID = "dyn-run"


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    from syncd.engine.reference.make_tiny import write_model

    return write_model(tmp_path_factory.mktemp("dyn-model") / "tiny", arch="qwen2", seed=3)


@dataclass
class ProxyProcess:
    """A running ``python -m syncd.engine.proxy``; :meth:`stop` sends SIGTERM (open trajectories get written)."""

    proc: subprocess.Popen
    url: str
    log: Path

    def stop(self) -> int | None:
        return stop_process(self.proc, 30)


def start_proxy(workdir: Path, upstream: str, store_url: str, sandbox_id: str, *extra: str) -> ProxyProcess:
    proc, url = proxy_procs.start_proxy(workdir, upstream, store_url, RUN_ID, sandbox_id, *extra)
    return ProxyProcess(proc, url, workdir / f"proxy-{sandbox_id}.log")


@pytest.fixture
def dynamo_env_clean(monkeypatch):
    """Tests that build Dynamo settings must not inherit a developer's DYN_* variables."""
    for var in list(os.environ):
        if var.startswith("DYN_") or var in ("ETCD_ENDPOINTS", "NATS_SERVER"):
            monkeypatch.delenv(var)
