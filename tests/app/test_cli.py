"""The daemon's command line: flags over SYNCD_* variables, `syncd status`, errors that say what is wrong."""

from __future__ import annotations

import asyncio
import io
import os

import pytest

from syncd import engine
from syncd.app import cli, commands
from syncd.daemon import DaemonConfig, NodeDaemon
from tests.daemon.conftest import KEY, RUN


def config(argv, monkeypatch, env=None):
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    args = cli._resolve(cli.build_parser().parse_args(argv))
    return cli._daemon_config(args)


def _daemon(tmp_path, published):
    """A reference engine with no version yet, and a fast-polling daemon for it over the published run."""
    eng = engine.StateDictEngine(published.zeros(), None)
    cfg = DaemonConfig(run_id=RUN, cache_dir=tmp_path / "cache", poll_interval_s=0.05, engine_check_s=0.1)
    return eng, NodeDaemon(cfg, adapters={"e0": eng}, store=published.store, signing_key=KEY)


def test_flags_override_environment(monkeypatch):
    env = {"SYNCD_RUN_ID": "from-env", "SYNCD_ENGINES": "a=http://127.0.0.1:1,http://127.0.0.1:2",
           "SYNCD_POLL_INTERVAL_S": "2.5", "SYNCD_CACHE_MAX_BYTES": "2G", "SYNCD_METRICS_PORT": "9464"}
    c = config([], monkeypatch, env)
    assert c.run_id == "from-env" and c.poll_interval_s == 2.5 and c.cache_max_bytes == 2 << 30
    assert [(e.name, e.url) for e in c.engines] == [("a", "http://127.0.0.1:1"), ("engine1", "http://127.0.0.1:2")]
    assert c.metrics_port == 9464
    c = config(["--run-id", "flag", "--poll-interval-s", "0.25", "--engine", "x=http://127.0.0.1:3",
                "--cache-max-bytes", "500M", "--metrics-port", ""], monkeypatch, env)
    assert c.run_id == "flag" and c.poll_interval_s == 0.25 and c.cache_max_bytes == 500 << 20
    assert [e.name for e in c.engines] == ["x"] and c.metrics_port is None


@pytest.mark.parametrize("argv, message", [
    (["--run-id", "r"], "--engine"),
    (["--run-id", "r", "--engine", "ftp://x"], "http://HOST:PORT"),
    (["--run-id", "r", "--engine", "http://127.0.0.1:1", "--cache-max-bytes", "lots"], "not a size"),
    (["--run-id", "r", "--engine", "http://127.0.0.1:1", "--poll-jitter", "1.5"], "jitter"),
    (["--run-id", "../bad", "--engine", "http://127.0.0.1:1"], "--run-id='../bad' is not a run id"),
])
def test_configuration_errors_exit_2(argv, message, monkeypatch, capsys, tmp_path):
    monkeypatch.delenv("SYNCD_ENGINES", raising=False)
    assert cli.main(argv + ["--store", str(tmp_path / "s"), "--cache-dir", str(tmp_path / "c")]) == 2
    assert message in capsys.readouterr().err


def test_status_reports_the_node(tmp_path, published, capsys, monkeypatch):
    published.publish(2)
    eng, d = _daemon(tmp_path, published)
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


DAEMON = ["--run-id", "r", "--engine", "http://127.0.0.1:9"]


@pytest.mark.parametrize("var, bad, argv", [
    ("SYNCD_POLL_INTERVAL_S", "often", DAEMON), ("SYNCD_POLL_JITTER", "some", DAEMON),
    ("SYNCD_BACKOFF_MAX_S", "long", DAEMON), ("SYNCD_ENGINE_CHECK_S", "x", DAEMON),
    ("SYNCD_DOWNLOAD_CONCURRENCY", "many", DAEMON), ("SYNCD_METRICS_PORT", "http", DAEMON),
    ("SYNCD_CACHE_MAX_BYTES", "lots", DAEMON), ("SYNCD_ENGINE_LEASE_S", "x", DAEMON),
    ("SYNCD_ENGINE_SCRUB_BYTES", "some", DAEMON), ("SYNCD_ENGINES", "ftp://x", ["--run-id", "r"]),
    ("SYNCD_LOG_LEVEL", "LOUD", DAEMON), ("SYNCD_LOG_FORMAT", "xml", DAEMON),
    ("SYNCD_ALLOW_UNSIGNED", "maybe", ["ls"]), ("SYNCD_STORE_OPTIONS", "novalue", ["ls"]),
    ("SYNCD_RUN_ID", "../bad", ["ls"]), ("SYNCD_KEEP_LAST", "few", ["gc", "--run-id", "r"]),
    ("SYNCD_GC_GRACE_S", "x", ["gc", "--run-id", "r"]), ("SYNCD_GC_ORPHAN_GRACE_S", "x", ["gc", "--run-id", "r"]),
    ("SYNCD_SIGNING_KEY", "short", ["ls"]), ("SYNCD_SIGNING_KEY_FILE", "/nonexistent/key", ["ls"]),
    ("SYNCD_STORE_ENDPOINT", "localhost:9000", ["ls", "--store", "s3://b/p"]),
    ("SYNCD_CLUSTER_RANK", "first", DAEMON), ("SYNCD_CLUSTER_FANOUT", "wide", DAEMON + ["--cluster-rank", "0"]),
])
def test_every_variable_is_named_in_its_own_error(var, bad, argv, monkeypatch, capsys, tmp_path):
    """A bad SYNCD_* value: exit 2, and the message names that variable (what the operator set), not the flag."""
    for v in list(os.environ):
        if v.startswith("SYNCD_"):
            monkeypatch.delenv(v)
    monkeypatch.setenv(var, bad)
    store = tmp_path / "store"
    store.mkdir()
    argv = argv + ([] if "--store" in argv else ["--store", str(store)])
    rc = cli.main(argv + (["--cache-dir", str(tmp_path / "c")] if argv[0] == "--run-id" else []))
    err = capsys.readouterr().err
    assert rc == 2 and var in err, (rc, err)


def test_one_info_line_per_applied_update_and_formatted_status(tmp_path, published, caplog):
    """At INFO the daemon says each update once (version, kind and size, engines, pauses, lag); `syncd status`
    prints totals in units people read (no 1.67954e+06) and '-' for what is not known."""
    import logging

    published.publish(4)
    eng, d = _daemon(tmp_path, published)

    async def main():
        task = asyncio.ensure_future(d.run())
        while not (eng.version == 3 and d.drivers["e0"].state == "serving"):
            await asyncio.sleep(0.02)
        d._write_status(force=True)
        d.request_stop()
        await task

    with caplog.at_level(logging.INFO, logger="syncd"):
        asyncio.run(asyncio.wait_for(main(), 60))
    lines = [r.getMessage() for r in caplog.records if r.name == "syncd.daemon.updates" and r.levelno == logging.INFO]
    applied = d.status.snapshot()["updates"]
    assert len(lines) == len(applied) >= 1, lines
    for line, u in zip(lines, applied):
        assert f"version {u['version']} (" in line and "serving on e0; pause " in line
        assert line.endswith(" s after it was published")
    assert any("rebuilt from full version" in ln for ln in lines) or any(" of " in ln and " kB)" in ln for ln in lines)
    out = io.StringIO()
    argv = ["status", "--run-id", RUN, "--cache-dir", str(tmp_path / "cache")]
    args = cli._resolve(cli.build_parser().parse_args(argv))
    commands.status(args, out)
    text = out.getvalue()
    assert "e+0" not in text and "None" not in text, text
    fetched = next(ln for ln in text.splitlines() if ln.strip().startswith("fetched bytes"))
    assert fetched.split()[-1] in ("B", "KiB", "MiB"), fetched


def test_a_closed_pipe_is_not_an_error(published):
    """`syncd ls | head`: the reader goes away; syncd exits 0 without a BrokenPipeError traceback."""
    import subprocess
    import sys

    published.publish(3)
    env = dict(os.environ, SYNCD_SIGNING_KEY=KEY)
    p = subprocess.Popen([sys.executable, "-m", "syncd.app.cli", "ls", "--store", published.store.url, "--run-id",
                          RUN], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    p.stdout.close()  # before it writes a byte: its first write meets a closed pipe
    err = p.stderr.read().decode()
    assert p.wait(60) == 0 and "BrokenPipe" not in err and "Traceback" not in err, err


def test_help_shows_defaults_and_keeps_cluster_flags_apart():
    text = cli.build_parser().format_help()
    assert "[SYNCD_POLL_INTERVAL_S; default 0.5]" in text and "[SYNCD_CACHE_MAX_BYTES; default 16G]" in text
    usage, _, rest = text.partition("\n\n")
    assert "--cluster" not in usage and len(usage.splitlines()) == 1
    assert rest.index("cluster mode") > rest.index("--engine-token-file")
    gc_help = next(a for a in cli.build_parser()._subparsers._group_actions[0].choices.items() if a[0] == "gc")[1]
    assert "[SYNCD_KEEP_LAST; default 8]" in gc_help.format_help()


def test_the_run_error_clears_once_versions_appear(tmp_path, published):
    """A daemon started before the trainer's first version says the run has none; once versions appear (found
    through the latest.json hint, without another listing) `syncd status` no longer says so."""
    eng, d = _daemon(tmp_path, published)
    seen = {}

    async def main():
        task = asyncio.ensure_future(d.run())
        while not d.status.get("run_error"):
            await asyncio.sleep(0.02)
        seen["before"] = d.status.get("run_error")
        await asyncio.to_thread(published.publish, 2)
        while not (eng.version == 1 and d.drivers["e0"].state == "serving"):
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)  # a few more polls
        d._write_status(force=True)
        out = io.StringIO()
        args = cli._resolve(cli.build_parser().parse_args(["status", "--run-id", RUN, "--cache-dir",
                                                           str(tmp_path / "cache")]))
        seen["rc"], seen["text"] = commands.status(args, out), out.getvalue()
        d.request_stop()
        await task

    asyncio.run(asyncio.wait_for(main(), 60))
    assert "has no versions" in seen["before"]
    assert seen["rc"] == 0 and "has no versions" not in seen["text"] and "run error" not in seen["text"], seen["text"]


@pytest.mark.parametrize("argv, own_flag", [
    (["--log-level", "DEBUG", "train", "--help"], "--curate"),
    (["--log-level=INFO", "serve", "--help"], "--workers"),
    (["--store", "memory://", "demo", "--help"], "--weights-only")])
def test_flags_before_a_program_command_go_to_that_program(argv, own_flag, capsys):
    with pytest.raises(SystemExit) as exc:  # before: syncd's own help and exit 2
        cli.main(argv)
    out = capsys.readouterr().out
    assert exc.value.code == 0 and own_flag in out, out[-2000:]


def test_a_flags_value_is_not_taken_for_a_command(tmp_path, capsys):
    (tmp_path / "store").mkdir()
    rc = cli.main(["--run-id", "demo", "--store", (tmp_path / "store").as_uri(), "ls"])
    err = capsys.readouterr().err
    assert rc == 1 and "demo" in err and "usage" not in err.lower(), err  # `ls` of run "demo": no versions


def test_a_syncd_flag_the_program_does_not_take_is_named_by_it(capsys):
    with pytest.raises(SystemExit) as exc:  # the demo has no --log-level: its parser says so, not syncd's help
        cli.main(["--log-level", "INFO", "demo"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "syncd demo" in err and "--log-level INFO" in err, err
