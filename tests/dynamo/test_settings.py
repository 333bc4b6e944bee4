"""Discovery/transport settings and the launcher's argument checks (no Dynamo processes)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from syncd.engine.dynamo import serve
from syncd.engine.dynamo.node import Node, NodeConfig
from syncd.engine.dynamo.settings import DynamoSettings, add_arguments, from_args


def test_file_backend_environment(tmp_path, dynamo_env_clean):
    env = DynamoSettings(file_kv=tmp_path / "kv", host="127.0.0.1").environ({"PATH": "/bin", "ETCD_ENDPOINTS": "x"})
    assert env["DYN_DISCOVERY_BACKEND"] == "file" and env["DYN_FILE_KV"] == str(tmp_path / "kv")
    assert env["DYN_REQUEST_PLANE"] == "tcp" and env["PATH"] == "/bin" and "ETCD_ENDPOINTS" not in env
    assert all(env[v] == "127.0.0.1" for v in ("DYN_TCP_RPC_HOST", "DYN_TCP_RESPONSE_STREAM_HOST",
                                                 "DYN_EVENT_PLANE_HOST", "DYN_SYSTEM_HOST"))
    assert DynamoSettings().resolved().file_kv is not None  # a default directory


def test_etcd_backend_environment_and_checks(dynamo_env_clean):
    s = DynamoSettings(discovery="etcd", etcd_endpoints="http://127.0.0.1:2379", nats_server="nats://127.0.0.1:4222")
    env = s.environ({})
    assert env["DYN_DISCOVERY_BACKEND"] == "etcd" and env["DYN_REQUEST_PLANE"] == "nats"
    assert env["ETCD_ENDPOINTS"] == "http://127.0.0.1:2379" and env["NATS_SERVER"] == "nats://127.0.0.1:4222"
    assert "DYN_FILE_KV" not in env
    with pytest.raises(ValueError, match="etcd endpoints"):
        DynamoSettings(discovery="etcd")
    with pytest.raises(ValueError, match="discovery backend"):
        DynamoSettings(discovery="zookeeper")
    with pytest.raises(ValueError, match="namespace"):
        DynamoSettings(namespace="a.b")


def test_flags_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("SYNCD_DYNAMO_NAMESPACE", "from-env")
    p = argparse.ArgumentParser()
    add_arguments(p)
    s = from_args(p.parse_args(["--file-kv", str(tmp_path)]))
    assert s.namespace == "from-env" and s.file_kv == Path(tmp_path)
    assert from_args(p.parse_args(s.argv())) == s
    assert from_args(p.parse_args(["--namespace", "flag"])).namespace == "flag"  # a flag beats the variable


def test_serve_refuses_bad_arguments(tmp_path, capsys):
    assert serve.main(["--model", str(tmp_path), "--workers", "1"]) == 2
    assert "config.json" in capsys.readouterr().err
    assert serve.main(["--model", str(tmp_path), "--workers", "0"]) == 2
    assert "at least one worker" in capsys.readouterr().err
    assert serve.main(["--model", str(tmp_path), "--discovery", "etcd"]) == 2
    assert "etcd endpoints" in capsys.readouterr().err


def test_file_discovery_drops_a_leftover_nats_event_plane():
    """A process that once ran with etcd + NATS must not hand a NATS event plane to file-discovery children."""
    from syncd.engine.dynamo.settings import DynamoSettings

    env = DynamoSettings(discovery="file", file_kv="/tmp/kv").environ(
        {"DYN_EVENT_PLANE": "nats", "NATS_SERVER": "nats://127.0.0.1:4222", "ETCD_ENDPOINTS": "http://x"})
    assert not {"DYN_EVENT_PLANE", "NATS_SERVER", "ETCD_ENDPOINTS"} & set(env)
    assert env["DYN_DISCOVERY_BACKEND"] == "file" and env["DYN_FILE_KV"] == "/tmp/kv"


def test_vllm_workers_get_cores_of_their_own(tmp_path, monkeypatch):
    """vLLM's automatic CPU binding would put every worker's threads on the same cores: the node gives each vLLM
    worker an equal share, unless the user bound them; other engines and more workers than cores are left alone."""
    import os

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("SYNCD_DYNAMO_ENGINE", raising=False)
    cores = sorted(os.sched_getaffinity(0))

    def envs(workers, args):
        node = Node(NodeConfig(model=tmp_path, run_dir=tmp_path / "n", workers=workers, worker_args=args))
        return [node._worker_env(i) for i in range(workers)]

    two = envs(2, ("--engine", "vllm"))
    if len(cores) >= 2:
        shares = [set(map(int, e["VLLM_CPU_OMP_THREADS_BIND"].split(","))) for e in two]
        assert not shares[0] & shares[1] and shares[0] | shares[1] <= set(cores) and all(shares)
    assert envs(2, ("--engine", "reference")) == [{}, {}]
    assert envs(len(cores) + 1, ("--engine", "vllm")) == [{}] * (len(cores) + 1)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    assert envs(2, ("--engine", "vllm")) == [{}, {}]


@pytest.fixture
def model_folder(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    return tmp_path / "model"


def test_a_taken_http_port_is_refused_at_once_naming_it(model_folder, tmp_path, capsys):
    """Nothing starts (no worker, no "node up" ready file, no restart loop): the flag and the port are named."""
    import socket
    import time

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        rc = serve.main(["--model", str(model_folder), "--frontend", "--http-port", str(port), "--run-dir",
                         str(tmp_path / "run"), "--ready-file", str(tmp_path / "node.json")])
        took = time.monotonic() - t0
    err = capsys.readouterr().err
    assert rc == 2 and f"--http-port {port}" in err and "in use" in err, err
    assert not (tmp_path / "node.json").exists() and not list((tmp_path / "run").glob("*.log"))
    assert took < 10, took  # no process was started (a worker alone takes longer to import torch)


def test_a_taken_system_port_base_is_refused_naming_it(model_folder, tmp_path, capsys):
    import socket

    from syncd.engine.dynamo.procs import MAX_SYSTEM_PORT
    from syncd.procs import free_port

    with socket.socket() as busy:
        port = free_port(below=MAX_SYSTEM_PORT)
        busy.bind(("127.0.0.1", port))
        busy.listen()
        rc = serve.main(["--model", str(model_folder), "--workers", "1", "--system-port-base", str(port),
                         "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 2 and f"--system-port-base {port}" in err, err


def test_a_restarted_worker_argv_has_no_weights_version():
    """(tests/dynamo/test_serve_node.py restarts a real one under a daemon.)"""
    from syncd.engine.dynamo.node import _without_weights_version

    argv = ["python", "-m", "w", "--weights-version", "3", "--run-id", "r", "--weights-version=4", "--x"]
    assert _without_weights_version(argv) == ["python", "-m", "w", "--run-id", "r", "--x"]


def test_serve_help_shows_defaults_and_its_own_name(capsys):
    with pytest.raises(SystemExit):
        serve.main(["--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: syncd serve ") and "python -m" not in out.splitlines()[0]
    assert "(default: 1)" in out and "(default: 5)" in out and "<run dir>/discovery" in out and "--unmanaged" in out
