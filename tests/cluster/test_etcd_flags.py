"""The etcd settings on both command lines: ``--etcd`` / ``--etcd-ttl-s`` of ``python -m syncd.cluster.node``
(``SYNCD_CLUSTER_ETCD``, else ``SYNCD_ETCD``) and the daemon's ``--cluster-etcd`` / ``--cluster-etcd-ttl-s``; etcd is
a source of members (with ``--advertise``, no static list is needed); bad values are refused, naming the problem."""

from __future__ import annotations

import pytest

from syncd.app import cli
from syncd.cluster import ClusterConfig
from syncd.cluster.cli import build_parser, config_from_args
from syncd.daemon.cluster import cluster_settings
from tests.cluster._util import SECRET

ENGINE = ["--run-id", "r", "--engine", "http://127.0.0.1:1"]
VARS = ("SYNCD_ETCD", "SYNCD_CLUSTER_ETCD", "SYNCD_CLUSTER_ETCD_TTL_S", "SYNCD_CLUSTER_RANK", "SYNCD_CLUSTER_PEERS",
        "SYNCD_CLUSTER_ADVERTISE", "SYNCD_CLUSTER_PEERS_FROM_STORE", "SYNCD_CLUSTER_SECRET_FILE", "SYNCD_ENGINES")


@pytest.fixture
def clean(monkeypatch):
    for k in VARS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("SYNCD_CLUSTER_SECRET", SECRET)
    return monkeypatch


def node_config(argv):
    return config_from_args(build_parser().parse_args(argv))


def test_node_flags_and_variables(clean):
    assert node_config(["--rank", "0", "--peers", "0=127.0.0.1:7400"]).etcd is None, "no etcd: the embedded election"
    clean.setenv("SYNCD_ETCD", "http://10.0.0.9:2379")
    cfg = node_config(["--rank", "3", "--advertise", "10.0.0.4:7400"])
    assert cfg.etcd == "http://10.0.0.9:2379" and cfg.etcd_ttl_s == 5 and cfg.peers is None
    assert cfg.advertise == ("10.0.0.4", 7400), "etcd is a source of members: an advertised address suffices"
    clean.setenv("SYNCD_CLUSTER_ETCD", "http://a:2379,http://b:2379")
    clean.setenv("SYNCD_CLUSTER_ETCD_TTL_S", "7")
    cfg = node_config(["--rank", "3", "--advertise", "10.0.0.4:7400"])
    assert cfg.etcd == "http://a:2379,http://b:2379" and cfg.etcd_ttl_s == 7, "the cluster's own variable wins"
    cfg = node_config(["--rank", "3", "--advertise", "10.0.0.4:7400", "--etcd", "https://c:2379", "--etcd-ttl-s", "2"])
    assert cfg.etcd == "https://c:2379" and cfg.etcd_ttl_s == 2, "a flag wins"


@pytest.mark.parametrize("kw, message", [
    ({"etcd": "etcd.example:2379", "advertise": ("h", 1)}, "not http(s)://HOST:PORT"),
    ({"etcd": "http://e:2379", "advertise": ("h", 1), "etcd_ttl_s": 1}, "2..3600"),
    ({"etcd": "http://e:2379"}, "advertised host:port"),
    ({}, "static peer list, a store directory (cluster_id) or etcd"),
])
def test_bad_etcd_settings_are_refused(kw, message):
    with pytest.raises(ValueError) as err:
        ClusterConfig(rank=0, **kw)
    assert message in str(err.value)


def test_daemon_flags(clean):
    s = cluster_settings(cli._resolve(cli.build_parser().parse_args(
        [*ENGINE, "--cluster-rank", "2", "--cluster-etcd", "http://10.0.0.9:2379", "--cluster-etcd-ttl-s", "3",
         "--cluster-advertise", "10.0.0.3:7400"])))
    assert (s.config.etcd, s.config.etcd_ttl_s, s.config.peers) == ("http://10.0.0.9:2379", 3, None)
    clean.setenv("SYNCD_ETCD", "http://10.0.0.8:2379")
    s = cluster_settings(cli._resolve(cli.build_parser().parse_args(
        [*ENGINE, "--cluster-rank", "2", "--cluster-advertise", "10.0.0.3:7400"])))
    assert s.config.etcd == "http://10.0.0.8:2379", "SYNCD_ETCD reaches the daemon's cluster node too"


def test_daemon_refuses_a_bad_etcd_url(clean, capsys, tmp_path):
    argv = [*ENGINE, "--cluster-rank", "0", "--cluster-etcd", "etcd:2379", "--cluster-advertise", "127.0.0.1:7400",
            "--store", str(tmp_path / "s"), "--cache-dir", str(tmp_path / "c")]
    assert cli.main(argv) == 2
    assert "not http(s)://HOST:PORT" in capsys.readouterr().err
