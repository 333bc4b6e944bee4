"""``syncd serve`` as an operator runs it, real processes only: each node's discovery is its own (a second node on the
same host never joins the first one's pool), and a worker killed with SIGKILL under a node daemon comes back and takes
traffic only once it holds the newest version (never the folder's stale weights it restarts with)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from syncd.engines.client import RemoteAdapter
from syncd.procs import stop_process, wait_until
from syncd.store import Store
from tests.dynamo._client import post_stream
from tests.engine._trainer import KEY, RUN, Trainer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def _env(tmp_path: Path, **extra) -> dict:
    """The environment of an operator's shell: no Dynamo settings of the test session's own; the runtime folder the
    old shared discovery default lived in is the test's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DYN_", "SYNCD_DYNAMO_", "SYNCD_SIGNING"))}
    (tmp_path / "xdg").mkdir(exist_ok=True)
    env.update(XDG_RUNTIME_DIR=str(tmp_path / "xdg"), SYNCD_LOG_LEVEL="INFO",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])), **extra)
    return env


class ServeNode:
    """One ``syncd serve --frontend`` process and its ready file."""

    def __init__(self, tmp_path: Path, name: str, model_dir, env: dict, *flags: str, worker_args=("--weights-version",
                                                                                                   "0")):
        self.dir = tmp_path / name
        self.ready = tmp_path / f"{name}.json"
        self.log = open(tmp_path / f"{name}.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "syncd.app.cli", "serve", "--model", str(model_dir), "--frontend", "--http-port",
             "0", "--run-dir", str(self.dir), "--ready-file", str(self.ready), *flags, "--", *worker_args],
            cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)

    def wait(self, timeout_s: float = 300) -> dict:
        wait_until(self.ready.exists, timeout_s, f"{self.dir.name} to come up", interval_s=0.2,
                   alive=lambda: self.proc.poll() is not None and f"serve exited: {self.tail()}")
        return self.describe()

    def describe(self) -> dict:
        return json.loads(self.ready.read_text())

    def tail(self) -> str:
        return (self.dir.parent / f"{self.dir.name}.log").read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        stop_process(self.proc, 60)
        self.log.close()


def _ask(frontend: str, model: str, seed: int, max_tokens: int = 3) -> tuple[int, list, list]:
    """One streamed completion: (status, the worker instance ids that served it, the weight version of each token)."""
    body = {"model": model, "prompt": "which worker", "max_tokens": max_tokens, "seed": seed, "ignore_eos": True,
            "nvext": {"extra_fields": ["worker_id", "engine_data"]}}
    status, _, events = post_stream(f"{frontend}/v1/completions", body, timeout=120)
    nv = [ev.get("nvext", {}) for ev in events if isinstance(ev, dict)]
    workers = [n["worker_id"]["decode_worker_id"] for n in nv if "worker_id" in n]
    versions = [v for n in nv if "engine_data" in n for v in n["engine_data"]["versions"]]
    return status, workers, versions


def test_a_second_node_on_the_host_does_not_join_the_first_ones_pool(model_dir, tmp_path):
    env = _env(tmp_path)
    nodes = [ServeNode(tmp_path, name, model_dir, env) for name in ("a", "b")]
    try:
        a, b = (n.wait() for n in nodes)
        assert a["file_kv"] != b["file_kv"] and Path(a["file_kv"]).is_relative_to(tmp_path / "a")
        mine = {w["instance_id"] for w in a["workers"]}
        served = []
        for seed in range(12):  # the frontend routes round robin: another node's worker would get every other one
            status, workers, _ = _ask(a["frontend"], a["model"], seed)
            assert status == 200
            served += workers
        assert served and set(served) <= mine, (served, mine, b["workers"])
        status, workers, _ = _ask(b["frontend"], b["model"], 0)
        assert status == 200 and set(workers) <= {w["instance_id"] for w in b["workers"]}
    finally:
        for n in nodes:
            n.stop()


def test_a_sigkilled_worker_takes_traffic_only_once_it_holds_the_newest_version(model_dir, tmp_path):
    """The node starts as the docs say (``-- --weights-version 0``: the folder is the run's version 0) and the daemon
    brings both workers to version 2. Worker 0 is killed with SIGKILL; ``syncd serve`` restarts it with the folder's
    weights, but without their version, so it registers only after the daemon has loaded version 2 into it. The
    daemon checks its engines every 3 s, which leaves a restarted worker that registered at once with version 0 long
    enough on the frontend's round robin to be caught. Every token served before, during and after the restart
    carries version 2; the restarted worker serves again."""
    trainer = Trainer(model_dir, Store(tmp_path / "store"))
    for _ in range(2):
        trainer.step()  # versions 0 (the folder's weights), 1, 2
    env = _env(tmp_path, SYNCD_SIGNING_KEY=KEY)
    node = ServeNode(tmp_path, "n", model_dir, env, "--workers", "2")
    daemon = None
    try:
        desc = node.wait()
        urls = {w["name"]: w["admin_url"] for w in desc["workers"]}
        argv = [sys.executable, "-m", "syncd.app.cli", "--run-id", RUN, "--store", str(tmp_path / "store"),
                "--cache-dir", str(tmp_path / "cache"), "--poll-interval-s", "0.2", "--engine-check-s", "3"]
        for name, url in urls.items():
            argv += ["--engine", f"{name}={url}"]
        with open(tmp_path / "daemon.log", "wb") as log:
            daemon = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True)
        adapters = {name: RemoteAdapter(url, timeout_s=10) for name, url in urls.items()}
        wait_until(lambda: all(a.version == 2 for a in adapters.values()), 240, "both workers at version 2",
                   interval_s=0.5, alive=lambda: daemon.poll() is not None and "the daemon exited")

        killed = next(w for w in desc["workers"] if w["name"] == "worker0")
        os.kill(killed["pid"], signal.SIGKILL)
        served, versions, failed, seed = [], [], 0, 0

        def back() -> dict | None:
            w = next(w for w in node.describe()["workers"] if w["name"] == "worker0")
            return w if w["restarts"] >= 1 and w["instance_id"] not in (None, killed["instance_id"]) else None

        deadline = time.monotonic() + 420
        while not (back() and served.count(back()["instance_id"]) >= 3):
            assert time.monotonic() < deadline, f"worker0 did not serve again: {node.tail()}"
            seed += 1
            status, workers, got = _ask(desc["frontend"], desc["model"], seed)
            failed += status != 200  # routed to the killed one before its discovery lease ran out
            served += workers
            versions += got
        assert set(versions) == {2}, sorted(set(versions))  # never the folder's version 0
        ready = json.loads((tmp_path / "n" / "worker0.ready.json").read_text())
        assert ready["version"] == 2 and back()["restarts"] == 1  # it registered holding version 2
        assert adapters["worker0"].version == 2
    finally:
        if daemon is not None:
            stop_process(daemon, 30)
        node.stop()
        trainer.close()
