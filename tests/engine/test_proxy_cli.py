"""``python -m syncd.engine.proxy`` start-up errors: a bad flag or ``SYNCD_*`` variable (an upstream URL without a
scheme included), a bad compaction model, a port in use -- each answers with exit status 2 or 3 and a line naming
what is wrong, never a traceback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from syncd.engine.proxy.cli import main
from syncd.engine.proxy.server import Proxy

REQUIRED = ["--upstream", "http://127.0.0.1:9", "--run-id", "run", "--sandbox-id", "sb"]


def test_a_bad_port_variable_leaves_help_working_and_is_named(monkeypatch, capsys):
    monkeypatch.setenv("SYNCD_PROXY_PORT", "abc")
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0 and "SYNCD_PROXY_PORT" in capsys.readouterr().out
    assert main(REQUIRED) == 2
    assert "SYNCD_PROXY_PORT='abc' is not a port number" in capsys.readouterr().err
    monkeypatch.setenv("SYNCD_PROXY_PORT", "70000")
    assert main(REQUIRED) == 2 and "SYNCD_PROXY_PORT='70000'" in capsys.readouterr().err


@pytest.mark.parametrize("argv, env, named", [
    (["--log-level", "BOGUS"], {}, "--log-level='BOGUS' is not a logging level"),
    ([], {"SYNCD_LOG_LEVEL": "loud"}, "SYNCD_LOG_LEVEL='loud' is not a logging level"),
])
def test_a_bad_log_level_is_named(monkeypatch, capsys, argv, env, named):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main(REQUIRED + argv) == 2
    assert named in capsys.readouterr().err


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from syncd.engine.reference.make_tiny import write_model

    return write_model(tmp_path_factory.mktemp("clim") / "tiny", arch="qwen2", seed=1, hidden=16, layers=1,
                       heads=2, kv_heads=1, intermediate=32, max_positions=128)


def test_a_bad_compaction_model_or_window_is_named(model, tmp_path, capsys):
    store = ["--store", str(tmp_path / "store")]
    assert main(REQUIRED + store + ["--compact-model", str(tmp_path / "none")]) == 2
    assert "config.json: no max_position_embeddings" in capsys.readouterr().err
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"vocab_size": 5}))
    assert main(REQUIRED + store + ["--compact-model", str(tmp_path / "m")]) == 2
    assert "no max_position_embeddings" in capsys.readouterr().err
    (tmp_path / "m" / "config.json").write_text(json.dumps({"max_position_embeddings": 128}))
    (tmp_path / "m" / "tokenizer.json").write_text("{not a tokenizer")
    assert main(REQUIRED + store + ["--compact-model", str(tmp_path / "m")]) == 2
    assert "tokenizer.json: not a tokenizer the compactor can read" in capsys.readouterr().err
    assert main(REQUIRED + store + ["--compact-model", str(model), "--compact-window", "4096"]) == 2
    assert "compaction window 4096 is past the model's 128 positions" in capsys.readouterr().err


def test_a_port_in_use_exits_3_with_a_message(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "syncd.engine.proxy", *REQUIRED, "--store", str(tmp_path / "s"),
                               "--port", str(port)], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "SYNCD_LOG_LEVEL": "WARNING"})
    assert proc.returncode == 3, proc.stderr
    assert f"cannot serve on 127.0.0.1:{port}" in proc.stderr and "Traceback" not in proc.stderr


async def _must_not_start(self, *args, **kwargs):
    raise AssertionError(f"the proxy started serving with --upstream {self.config.upstream!r}")


@pytest.mark.parametrize("upstream, named", [
    ("127.0.0.1:8000", "--upstream '127.0.0.1:8000' has no scheme (did you mean http://127.0.0.1:8000?)"),
    ("localhost:8000", "--upstream 'localhost:8000' has no scheme"),
    ("http://127.0.0.1:99999", "--upstream 'http://127.0.0.1:99999' has an invalid port"),
    ("grpc://127.0.0.1:8000", "--upstream 'grpc://127.0.0.1:8000' has the scheme 'grpc'"),
])
def test_an_upstream_without_a_usable_url_is_named_at_start(tmp_path, capsys, monkeypatch, upstream, named):
    """Before: ``--upstream 127.0.0.1:8000`` started, and every request failed later with a 502."""
    monkeypatch.setattr(Proxy, "start", _must_not_start)
    argv = ["--upstream", upstream, "--run-id", "run", "--sandbox-id", "sb", "--store", str(tmp_path / "s")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert named in err and "e.g. http://127.0.0.1:8000" in err and "Traceback" not in err


def test_an_upstream_variable_without_a_scheme_is_named(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(Proxy, "start", _must_not_start)
    monkeypatch.setenv("SYNCD_PROXY_UPSTREAM", "frontend:8000")
    assert main(["--run-id", "run", "--sandbox-id", "sb", "--store", str(tmp_path / "s")]) == 2
    assert "SYNCD_PROXY_UPSTREAM 'frontend:8000' has no scheme" in capsys.readouterr().err
