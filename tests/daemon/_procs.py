"""Real processes for the daemon tests: engine processes (``python -m syncd.engine.control_server``), daemons
(``python -m syncd.app.cli``) and trainers (``tests.daemon._trainer_child``), with their logs in files, bounded
waits that say what they waited for (and show the logs), and cleanup of every child even on failure."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import syncd.procs
from syncd.engines.client import RemoteAdapter
from tests.daemon.conftest import KEY, RUN

ROOT = Path(__file__).resolve().parents[2]


class Procs:
    """Starts and tracks the children of one test under ``tmp``."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.children: list[tuple[str, subprocess.Popen, Path]] = []
        self.env = dict(os.environ, SYNCD_SIGNING_KEY=KEY, SYNCD_LOG_LEVEL="INFO", OMP_NUM_THREADS="1",
                        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        for var in ("SYNCD_TEST_PAUSE_AT", "SYNCD_STORE", "SYNCD_RUN_ID", "SYNCD_ENGINES"):
            self.env.pop(var, None)

    def spawn(self, name: str, args: list[str], env: dict | None = None) -> subprocess.Popen:
        log = self.tmp / f"{name}.{len(self.children)}.log"
        fh = open(log, "wb")
        p = subprocess.Popen([sys.executable, *args], cwd=ROOT, env={**self.env, **(env or {})}, stdout=fh,
                             stderr=subprocess.STDOUT, start_new_session=True)
        fh.close()
        self.children.append((name, p, log))
        return p

    def logs(self, tail: int = 3000) -> str:
        out = []
        for name, p, log in self.children:
            text = log.read_text(errors="replace") if log.exists() else ""
            text = "\n".join(line for line in text.splitlines() if "torchao" not in line and "_pytree" not in line)
            out.append(f"----- {name} (pid {p.pid}, rc {p.poll()}) {log.name}\n{text[-tail:]}")
        return "\n".join(out)

    def wait(self, cond, what: str, timeout: float = 90.0, interval: float = 0.05):
        try:
            return syncd.procs.wait_until(cond, timeout, what, interval_s=interval,
                                          not_yet=(OSError, ValueError, KeyError))
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\n{self.logs()}") from None

    def close(self) -> None:
        for _, p, _ in self.children:
            if p.poll() is None:
                p.kill()
        for _, p, _ in self.children:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass

    # ------------------------------------------------------------------------------------- the parts

    def engine(self, model: Path, *, port: int = 0, headless: bool = False, name: str = "engine",
               module: str = "syncd.engine.control_server", extra: list[str] = ()) -> tuple:
        ready = self.tmp / f"{name}.{len(self.children)}.ready"
        args = ["-m", module, "--model", str(model), "--port", str(port), "--ready-file", str(ready), *extra]
        p = self.spawn(name, args + (["--headless"] if headless else []))
        info = self.wait(lambda: ready.exists() and json.loads(ready.read_text()), f"{name} to serve", 120)
        return p, info["url"]

    def daemon(self, store: Path, cache: Path, urls: list[str], *, hooks: str | None = None,
               mark_dir: Path | None = None, extra: list[str] = (), run_id: str = RUN,
               env: dict | None = None) -> subprocess.Popen:
        module = "tests.daemon._hooks" if hooks else "syncd.app.cli"  # the hooks hold the daemon at a point
        args = ["-m", module, "--run-id", run_id, "--store", str(store), "--cache-dir", str(cache),
                "--poll-interval-s", "0.1", "--backoff-max-s", "0.5", "--engine-check-s", "0.2", "--metrics-port", "0",
                *extra]
        for i, u in enumerate(urls):
            args += ["--engine", f"e{i}={u}"]
        env = dict(env or {})
        if hooks:
            env.update(SYNCD_TEST_PAUSE_AT=hooks, SYNCD_TEST_MARK_DIR=str(mark_dir))
        return self.spawn("daemon", args, env)

    def cli(self, *args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
        """Run ``python -m syncd.app.cli ARGS`` to completion; its exit status and output."""
        return subprocess.run([sys.executable, "-m", "syncd.app.cli", *args], cwd=ROOT, env={**self.env, **(env or {})},
                              capture_output=True, text=True, timeout=timeout)

    def trainer(self, store: Path, model: Path, steps: int, *, gate_dir: Path | None = None, record: Path,
                extra: list[str] = ()) -> subprocess.Popen:
        args = ["-m", "tests.daemon._trainer_child", str(store), RUN, "--model", str(model), "--steps",
                str(steps), "--record", str(record), *extra]
        if gate_dir is not None:
            args += ["--gate-dir", str(gate_dir)]
        return self.spawn("trainer", args)


def open_gates(gate_dir: Path, *steps: int) -> None:
    gate_dir.mkdir(exist_ok=True)
    for s in steps:
        (gate_dir / str(s)).touch()


def trainer_record(record: Path) -> dict[int, dict]:
    """The trainer's record: version -> {"step", "checksums": {name: int}}."""
    out = {}
    for line in record.read_text().splitlines():
        r = json.loads(line)
        out[r["version"]] = {"step": r["step"], "checksums": {k: int(v, 16) for k, v in r["checksums"].items()}}
    return out


def engine_version(url: str):
    return RemoteAdapter(url, connect_timeout_s=2).version


def engine_checksums(url: str) -> dict[str, int]:
    return RemoteAdapter(url, connect_timeout_s=2).checksum()


def status(cache: Path, run_id: str = RUN) -> dict:
    return json.loads((cache / f"status-{run_id}.json").read_text())


def status_at(procs, cache: Path, version: int, engine: str = "e0", run_id: str = RUN) -> dict:
    """The status file once it shows ``engine`` at ``version``: an engine serves a version before the daemon
    writes that it does, so a read right after the engine answers can be one write behind."""
    return procs.wait(lambda: (st := status(cache, run_id))["engines"][engine]["version"] == version and st,
                      f"the status file to show {engine} at version {version}")


def metrics(cache: Path, run_id: str = RUN) -> str:
    return urllib.request.urlopen(status(cache, run_id)["metrics_url"], timeout=10).read().decode()


def metric(cache: Path, line_prefix: str, run_id: str = RUN) -> float:
    for line in metrics(cache, run_id).splitlines():
        if line.startswith(line_prefix + " "):
            return float(line.split()[-1])
    return 0.0


def generate(url: str, prompt=(1, 2, 3), max_tokens: int = 3, seed: int = 1) -> list[dict]:
    body = json.dumps({"request_id": f"t{time.monotonic_ns()}", "prompt_token_ids": list(prompt),
                       "max_tokens": max_tokens, "seed": seed}).encode()
    with urllib.request.urlopen(urllib.request.Request(url + "/generate", data=body, method="POST"),
                                timeout=60) as r:
        return [json.loads(line) for line in r.read().splitlines()]


def kill9(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)


async def wait_until(cond, what: str, timeout: float = 60.0) -> None:
    """Await ``cond()`` turning true (polled every 20 ms); AssertionError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)
