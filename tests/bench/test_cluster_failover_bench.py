"""bench/cluster_failover.py runs end to end at a small size (real node processes and a real etcd; the partition
in network namespaces where this machine allows them) and writes its figures."""

from __future__ import annotations

import json

import pytest

from bench import cluster_failover
from bench import netsim as sim

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_cluster_failover_bench_tiny(tmp_path, capsys):
    out = tmp_path / "res.json"
    netns = sim.netns_available() is None
    rc = cluster_failover.main(["--nodes", "4", "--repeats", "1", "--heartbeat-s", "0.25", "--ttl-s", "2",
                                "--partition", "etcd" if netns else "none", "--json", str(out),
                                "--plot", str(tmp_path / "f.png")])
    assert rc == 0
    res = json.loads(out.read_text())
    assert 0 < res["failover_s_etcd"] < 3 * 2 + 2, "bound by the lease (2 s), plus a heartbeat and a poll"
    assert 0 < res["failover_s_builtin"] < 6 * 0.25 + 2, "bound by two dead-after periods, plus a poll"
    assert [r["election"] for r in res["failover"]] == ["etcd", "builtin"]
    if netns:
        assert res["partition_skipped"] is None
        assert res["reads_per_shard_after"] == pytest.approx(1.0), "after healing each shard crosses the link once"
        assert 1.0 <= res["reads_per_shard_during"] <= 2.0
    else:
        assert res["reads_per_shard_during"] is None and res["partition_skipped"], "the reason is recorded"
    assert "failover: etcd election" in capsys.readouterr().out
    assert (tmp_path / "f.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
