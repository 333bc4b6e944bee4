"""The daemon's command line: flags over SYNCD_* variables, `syncd status`, errors that say what is wrong."""

from __future__ import annotations

import asyncio
import io
import os

import pytest

import engine
from syncd.app import cli, commands
from syncd.daemon import DaemonConfig, NodeDaemon
from tests.daemon.conftest import KEY, RUN


def config(argv, monkeypatch, env=None):
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    args = cli._resolve(cli.build_parser().parse_args(argv))
    return cli._daemon_config(args)


def test_flags_override_environment(monkeypatch):
    env = {"SYNCD_RUN_ID": "from-env", "SYNCD_ENGINES": "a=http://127.0.0.1:1,http://127.0.0.1:2",
           "SYNCD_POLL_INTERVAL_S": "2.5", "SYNCD_CACHE_MAX_BYTES": "2G", "SYNCD_METRICS_PORT": "9464"}
    c = config([], monkeypatch, env)
    assert c.run_id == "from-env" and c.poll_interval_s == 2.5 and c.cache_max_bytes == 2 << 30
    assert [(e.name, e.url) for e in c.engines] == [("a", "http://127.0.0.1:1"), ("engine1", "http://127.0.0.1:2")]
    assert c.metrics_port == 9464
    c = config(["--run-id", "flag", "--poll-interval", "0.25", "--engine", "x=http://127.0.0.1:3",
                "--cache-max-bytes", "500M", "--metrics-port", ""], monkeypatch, env)
    assert c.run_id == "flag" and c.poll_interval_s == 0.25 and c.cache_max_bytes == 500 << 20
    assert [e.name for e in c.engines] == ["x"] and c.metrics_port is None


@pytest.mark.parametrize("argv, message", [
    (["--run-id", "r"], "--engine"),
    (["--run-id", "r", "--engine", "ftp://x"], "http://HOST:PORT"),
    (["--run-id", "r", "--engine", "http://127.0.0.1:1", "--cache-max-bytes", "lots"], "not a size"),
    (["--run-id", "r", "--engine", "http://127.0.0.1:1", "--poll-jitter", "1.5"], "jitter"),
    (["--run-id", "../bad", "--engine", "http://127.0.0.1:1"], "invalid run id"),
])
def test_configuration_errors_exit_2(argv, message, monkeypatch, capsys, tmp_path):
    monkeypatch.delenv("SYNCD_ENGINES", raising=False)
    assert cli.main(argv + ["--store", str(tmp_path / "s"), "--cache-dir", str(tmp_path / "c")]) == 2
    assert message in capsys.readouterr().err


def test_status_reports_the_node(tmp_path, published, capsys, monkeypatch):
    published.publish(2)
    eng = engine.StateDictEngine(published.zeros(), None)
    cfg = DaemonConfig(run_id=RUN, cache_dir=tmp_path / "cache", poll_interval_s=0.05, engine_check_s=0.1)
    d = NodeDaemon(cfg, adapters={"e0": eng}, store=published.store, signing_key=KEY)
    seen = {}

    async def main():
        task = asyncio.ensure_future(d.run())
        while not (eng.version == 1 and d.drivers["e0"].state == "serving"):
            await asyncio.sleep(0.02)
        d._write_status(force=True)
        out = io.StringIO()
        args = cli._resolve(cli.build_parser().parse_args(["status", "--run-id", RUN, "--cache-dir",
                                                           str(tmp_path / "cache")]))
        seen["running"] = (commands.status(args, out), out.getvalue())
        d.request_stop()
        await task

    asyncio.run(asyncio.wait_for(main(), 60))
    rc, text = seen["running"]
    assert rc == 0, text
    assert "running" in text and "newest version 1" in text
    assert [ln.split()[:3] for ln in text.splitlines() if ln.startswith("e0")] == [["e0", "1", "0"]]
    # stopped: still readable, exit 1 (not running)
    assert cli.main(["status", "--run-id", RUN, "--cache-dir", str(tmp_path / "cache")]) == 1
    assert "not running" in capsys.readouterr().out
    assert cli.main(["status", "--run-id", "other", "--cache-dir", str(tmp_path / "cache")]) == 3
    assert os.path.exists(tmp_path / "cache" / f"status-{RUN}.json")
