"""Ctrl-C during ``syncd demo``, as a terminal sends it (SIGINT to the demo's process group): at any point, once or
twice, every process the demo started stops (each runs in a process group of its own, killed whole), the demo
says "interrupted; stopped N processes" without a traceback and exits 130, and its temporary work directory is
gone. Two points: twice while the serving side starts, once while the trainer runs."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def _left_behind(marker: str) -> list[str]:
    """Live processes (not zombies) whose command line holds ``marker``, but this one."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmd and state != "Z":
            out.append(f"{proc.name}: {cmd[:200]}")
    return out


class Demo:
    """``syncd demo`` in a session of its own (as a shell runs a foreground job), its stdout read line by line."""

    def __init__(self, tmp_path: Path, *flags: str):
        self.tmp = tmp_path / "tmp"
        self.tmp.mkdir()
        env = dict(os.environ, TMPDIR=str(self.tmp),
                   PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        self.proc = subprocess.Popen([sys.executable, "-m", "syncd.app.cli", "demo", "--plain", "--workers", "1",
                                      "--nproc", "1", *flags], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_for(self, text: str, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(text in ln for ln in self.lines):
            assert self.proc.poll() is None, "".join(self.lines)[-3000:] + self.proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, f"no {text!r} after {timeout_s} s: {''.join(self.lines)[-3000:]}"
            time.sleep(0.05)

    def ctrl_c(self) -> None:
        os.killpg(self.proc.pid, signal.SIGINT)

    def finish(self) -> tuple[int, str]:
        try:
            rc = self.proc.wait(timeout=180)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise
        self._reader.join(10)
        return rc, self.proc.stderr.read()


def _check_stopped(demo: Demo, rc: int, err: str, at_least: int) -> None:
    assert rc == 130, (rc, err[-3000:], "".join(demo.lines)[-2000:])
    said = re.search(r"^interrupted; stopped (\d+) process(es)?$", err, re.M)
    assert said and int(said.group(1)) >= at_least, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    deadline = time.monotonic() + 30  # killed groups' last members are reaped by init
    while _left_behind(str(demo.tmp)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _left_behind(str(demo.tmp)), _left_behind(str(demo.tmp))
    assert not list(demo.tmp.glob("syncd-*")), list(demo.tmp.iterdir())  # the temporary work dir is gone


def test_ctrl_c_twice_while_the_serving_side_starts(tmp_path):
    demo = Demo(tmp_path, "--steps", "3")
    demo.wait_for("starting the Dynamo frontend")
    deadline = time.monotonic() + 300
    while not _left_behind(str(demo.tmp)):  # the node's first process is up (it loads torch for a while)
        assert demo.proc.poll() is None and time.monotonic() < deadline, "".join(demo.lines)[-3000:]
        time.sleep(0.05)
    demo.ctrl_c()
    time.sleep(0.3)
    demo.ctrl_c()  # the second one: no more waiting for a graceful stop
    rc, err = demo.finish()
    _check_stopped(demo, rc, err, at_least=1)


def test_ctrl_c_once_while_the_trainer_runs(tmp_path):
    demo = Demo(tmp_path, "--steps", "50")
    demo.wait_for("starting the trainer")
    time.sleep(2.0)
    demo.ctrl_c()
    rc, err = demo.finish()
    _check_stopped(demo, rc, err, at_least=6)  # worker, frontend, proxy, daemon, rollout service, trainer
