"""The production-style path: ``syncd serve --start-services`` (``syncd.engine.dynamo.serve``) runs etcd and NATS (Debian's
packages, installed by ``scripts/setup_services.sh``), two reference-engine workers and the frontend as
real processes; a sandbox proxy in front records a trajectory; SIGTERM stops everything cleanly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from syncd.engines.client import RemoteAdapter
from syncd.procs import stop_process, wait_until
from syncd.engine.dynamo.services import find_binary
from syncd.records.trajectory import read_record
from tests.dynamo._client import finish_reason, post_json, post_stream, stream_text
from tests.dynamo.conftest import RUN_ID, start_proxy

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def test_node_with_etcd_and_nats(model_dir, tmp_path):
    find_binary("etcd"), find_binary("nats-server")  # a clear error if scripts/setup_services.sh was not run
    store_url = (tmp_path / "store").resolve().as_uri()
    (tmp_path / "store").mkdir()
    ready = tmp_path / "node.json"
    log = open(tmp_path / "serve.log", "wb")
    serve = subprocess.Popen(
        [sys.executable, "-m", "syncd.app.cli", "serve", "--model", str(model_dir), "--workers", "2", "--frontend",
         "--http-port", "0", "--start-services", "--namespace", "etcdtest", "--run-dir", str(tmp_path / "run"),
         "--ready-file", str(ready), "--", "--weights-version", "0", "--replay-store", store_url, "--run-id", RUN_ID],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    proxy = None
    try:
        wait_until(ready.exists, 240, "the node to come up",
                   alive=lambda: serve.poll() is not None and f"serve exited: {(tmp_path / 'serve.log').read_text()[-3000:]}")
        node = json.loads(ready.read_text())
        assert node["discovery"] == "etcd" and node["etcd_endpoints"].startswith("http://127.0.0.1:")
        assert node["nats_server"].startswith("nats://127.0.0.1:") and len(node["workers"]) == 2
        assert all(RemoteAdapter(w["admin_url"]).version == 0 for w in node["workers"])

        proxy = start_proxy(tmp_path, node["frontend"], store_url, "sb-etcd")
        hdr = {"X-Syncd-Trajectory": "etcd-1"}
        chat = {"model": node["model"], "messages": [{"role": "user", "content": "over nats"}], "max_tokens": 16,
                "seed": 4, "temperature": 1.0}
        status, _, events = post_stream(f"{proxy.url}/v1/chat/completions", chat, headers=hdr)
        assert status == 200 and finish_reason(events) in ("length", "stop")
        status, _, whole = post_json(f"{proxy.url}/v1/chat/completions", chat, headers=hdr)
        assert status == 200 and whole["choices"][0]["message"]["content"] == stream_text(events, chat=True)
        assert post_json(f"{proxy.url}/syncd/trajectories/etcd-1/finish", {})[0] == 200
        rec = read_record(store_url, RUN_ID, "sb-etcd", "etcd-1")
        assert rec["status"] == "complete"
        a, b = rec["turns"]
        assert a["output_token_ids"] == b["output_token_ids"] and set(a["versions"]) == {0}

        children = [w["pid"] for w in node["workers"]]
        os.kill(serve.pid, signal.SIGTERM)
        assert serve.wait(90) == 0
        assert not any(_pid_alive(p) for p in children)
    finally:
        if proxy is not None:
            proxy.stop()
        stop_process(serve, 30)
        log.close()
