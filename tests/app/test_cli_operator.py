"""Operator mistakes on the ``syncd`` command line answered at once and by name: a second daemon on a cache directory
or status file (refused, naming the holder, so `syncd status` never flips between two), a taken --metrics-port, a
--cache-dir that cannot be written, a signed run read without its key (one summary, not a refusal per version);
and the command line's own face: ``syncd --version``, sub-command usage lines that start ``syncd <command>``."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time

import pytest

from syncd import engine
from syncd.app import cli
from syncd.daemon import DaemonConfig, NodeDaemon
from syncd.daemon.status import DaemonLockHeld, read_status
from tests.daemon.conftest import KEY, RUN


def _state(path):
    try:
        return read_status(path).get("state")
    except (OSError, ValueError):
        return None


def _daemon(tmp_path, published, status_file=None, cache="cache"):
    eng = engine.StateDictEngine(published.zeros(), None)
    cfg = DaemonConfig(run_id=RUN, cache_dir=tmp_path / cache, poll_interval_s=0.05, engine_check_s=0.1,
                       status_file=status_file)
    return NodeDaemon(cfg, adapters={"e0": eng}, store=published.store, signing_key=KEY)


@pytest.mark.parametrize("shared", ["cache directory", "status file"])
def test_a_second_daemon_is_refused_naming_the_first(tmp_path, published, shared):
    published.publish(2)
    first = _daemon(tmp_path, published)
    second = (_daemon(tmp_path, published) if shared == "cache directory" else
              _daemon(tmp_path, published, status_file=first.status.path, cache="other-cache"))

    async def main():
        task = asyncio.ensure_future(first.run())
        while _state(first.status.path) != "running":
            await asyncio.sleep(0.02)
        with pytest.raises(DaemonLockHeld) as refused:
            await second.run()
        assert read_status(first.status.path)["pid"] == first.status.snapshot()["pid"]  # untouched by the second
        first.request_stop()
        await task
        return str(refused.value)

    said = asyncio.run(asyncio.wait_for(main(), 60))
    assert f"the {shared}" in said and "in use by another syncd daemon" in said and f"run {RUN}" in said, said
    assert "pid " in said and "since " in said
    third = _daemon(tmp_path, published)  # the first one stopped: its locks are free again

    async def again():
        task = asyncio.ensure_future(third.run())
        while _state(third.status.path) != "running":
            await asyncio.sleep(0.02)
        third.request_stop()
        await task

    asyncio.run(asyncio.wait_for(again(), 60))


def test_a_second_daemon_process_exits_2_and_status_keeps_showing_the_first(tmp_path, published, capsys):
    """Two `syncd` processes on one cache directory: the second exits 2 at once naming the first's pid, which
    `syncd status` goes on showing (it used to flip between the two)."""
    import os

    published.publish(2)
    argv = ["--run-id", RUN, "--store", published.store.url, "--cache-dir", str(tmp_path / "cache"),
            "--engine", "e0=http://127.0.0.1:9", "--metrics-port", ""]
    env = dict(os.environ, SYNCD_SIGNING_KEY=KEY)
    first = subprocess.Popen([sys.executable, "-m", "syncd.app.cli", *argv], env=env, stderr=subprocess.PIPE)
    try:
        status_file = tmp_path / "cache" / f"status-{RUN}.json"
        deadline = time.monotonic() + 120
        while not (status_file.exists() and read_status(status_file).get("pid") == first.pid):
            assert first.poll() is None and time.monotonic() < deadline, first.stderr.read().decode()[-2000:]
            time.sleep(0.1)
        p = subprocess.run([sys.executable, "-m", "syncd.app.cli", *argv], env=env, capture_output=True, text=True,
                           timeout=120)
        assert p.returncode == 2 and f"pid {first.pid}" in p.stderr and "--cache-dir" in p.stderr, p.stderr
        assert read_status(status_file)["pid"] == first.pid
    finally:
        first.terminate()
        first.wait(60)


def test_a_taken_metrics_port_is_named(tmp_path, monkeypatch, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        rc = cli.main(["--run-id", "r", "--store", str(tmp_path / "s"), "--cache-dir", str(tmp_path / "c"),
                       "--engine", "http://127.0.0.1:1", "--metrics-port", str(port)])
        err = capsys.readouterr().err
        assert rc == 2 and f"--metrics-port={port}" in err and "in use" in err, err
        monkeypatch.setenv("SYNCD_METRICS_PORT", str(port))
        rc = cli.main(["--run-id", "r", "--store", str(tmp_path / "s"), "--cache-dir", str(tmp_path / "c"),
                       "--engine", "http://127.0.0.1:1"])
        err = capsys.readouterr().err
        assert rc == 2 and f"SYNCD_METRICS_PORT={port}" in err, err


def test_a_cache_dir_that_cannot_be_written_is_named_at_start(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    rc = cli.main(["--run-id", "r", "--store", str(tmp_path / "s"), "--cache-dir", str(blocker / "cache"),
                   "--engine", "http://127.0.0.1:1"])
    err = capsys.readouterr().err
    assert rc == 2 and "--cache-dir" in err and "cannot be written" in err, err


def test_a_signed_run_without_its_key_gets_one_summary(tmp_path, monkeypatch, capsys):
    import torch

    from syncd.publish.publisher import WeightPublisher
    from syncd.signing.keyfiles import write_keypair

    _, public, key = write_keypair(tmp_path / "k")
    with WeightPublisher(tmp_path / "store", "signed", signing_key=key, full_every=2) as pub:
        for step in range(4):
            pub.publish({"w": torch.full((8, 8), float(step))}, step)
    for var in ("SYNCD_SIGNING_KEY", "SYNCD_SIGNING_KEY_FILE", "SYNCD_VERIFY_KEYS", "SYNCD_ALLOW_UNSIGNED"):
        monkeypatch.delenv(var, raising=False)
    capsys.readouterr()
    base = ["--store", str(tmp_path / "store"), "--run-id", "signed"]
    for command in (["ls"], ["gc", "--dry-run"]):
        assert cli.main([*command, *base]) == 2
        out, err = capsys.readouterr()
        said = out + err
        assert said.count("versions 0-3 are signed") == 1 and "SignatureError" not in said, said
        assert "--verify-key" in said and len(said.strip().splitlines()) <= 2, said  # the summary (and a log line)
    assert cli.main(["ls", *base, "--verify-key", str(public.with_suffix(".pub"))]) == 0
    assert capsys.readouterr().out.count("ok (signed ed25519") == 4


def test_version_and_sub_command_usage_lines(capsys):
    from syncd import __version__

    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"syncd {__version__}"
    for command in ("ls", "status", "verify", "gc", "materialize"):
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        usage = capsys.readouterr().out.splitlines()[0]
        assert usage.startswith(f"usage: syncd {command} [-h]"), usage  # not the main usage line with it appended
