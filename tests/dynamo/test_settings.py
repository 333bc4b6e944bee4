"""Discovery/transport settings and the launcher's argument checks (no processes)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from syncd.engine.dynamo import serve
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
        node = serve.Node(serve.NodeConfig(model=tmp_path, run_dir=tmp_path / "n", workers=workers, worker_args=args))
        return [node._worker_env(i) for i in range(workers)]

    two = envs(2, ("--engine", "vllm"))
    if len(cores) >= 2:
        shares = [set(map(int, e["VLLM_CPU_OMP_THREADS_BIND"].split(","))) for e in two]
        assert not shares[0] & shares[1] and shares[0] | shares[1] <= set(cores) and all(shares)
    assert envs(2, ("--engine", "reference")) == [{}, {}]
    assert envs(len(cores) + 1, ("--engine", "vllm")) == [{}] * (len(cores) + 1)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    assert envs(2, ("--engine", "vllm")) == [{}, {}]
