"""The daemon's metrics by the Prometheus conventions, checked on prometheus_client's own exposition of a daemon that
rebuilt one engine and updated it: names (units, ``_total``), every name documented in docs/metrics.md, the renamed
ones exported under both names, unknown as absent/NaN, a rebuild apart from the updates, ``syncd_build_info``, and
every series the Grafana dashboard in docs/ queries."""

from __future__ import annotations

import asyncio
import json
import math
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

import syncd.engine
from syncd.daemon import DaemonConfig, NodeDaemon
from syncd.daemon.metrics import DEPRECATED, DaemonMetrics
from tests.daemon.conftest import KEY, RUN

DOCS = Path(__file__).resolve().parents[2] / "docs"


def families(text: str) -> dict:
    """The exposition's families, without the ``*_created`` timestamps the client adds to counters/histograms."""
    return {f.name: f for f in text_string_to_metric_families(text) if not f.name.endswith("_created")}


def samples(fams: dict) -> dict:
    """sample name + sorted labels -> value"""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams.values() for s in f.samples}


def documented() -> set[str]:
    table = (DOCS / "metrics.md").read_text().split("## Renamed")[0]
    return set(re.findall(r"^\| `(syncd_[a-z0-9_]+)`", table, re.M))


def test_before_anything_is_known():
    fams = families(DaemonMetrics().render().decode())
    s = samples(fams)
    assert math.isnan(s[("syncd_newest_version", ())])  # not 0: version 0 exists
    assert not [k for k in s if k[0] in ("syncd_engine_version", "syncd_engine_lag_versions")]
    (info,) = [v for k, v in s.items() if k[0] == "syncd_build_info"]
    assert info == 1.0
    labels = dict(next(k for k in s if k[0] == "syncd_build_info")[1])
    assert set(labels) == {"version", "python"} and labels["version"]


def test_names_units_docs_and_dashboard(tmp_path, published):
    published.publish(3)
    eng = syncd.engine.StateDictEngine(published.zeros(), None)  # no version: the daemon rebuilds it, then updates it
    cfg = DaemonConfig(run_id=RUN, cache_dir=tmp_path / "cache", poll_interval_s=0.05, engine_check_s=0.1)
    d = NodeDaemon(cfg, adapters={"e0": eng}, store=published.store, signing_key=KEY)

    async def main():
        task = asyncio.ensure_future(d.run())
        while not (eng.version == 2 and d.drivers["e0"].state == "serving"):
            await asyncio.sleep(0.02)
        published.publish(3)  # live updates of a serving engine
        while not (eng.version == 5 and d.drivers["e0"].state == "serving"):
            await asyncio.sleep(0.02)
        d._write_status(force=True)
        text = d.metrics.render().decode()
        d.request_stop()
        await task
        return text

    fams = families(asyncio.run(asyncio.wait_for(main(), 60)))
    s = samples(fams)
    # conventions: counters end in _total, histograms and durations in _seconds, sizes in _bytes
    for name, f in fams.items():
        assert re.fullmatch(r"syncd_[a-z0-9_]+", name), name
        if f.type == "counter":
            assert all(x.name.endswith(("_total", "_created")) for x in f.samples), name
        if f.type == "histogram":
            assert name.endswith("_seconds"), name
        assert "bytes" not in name or name.endswith("_bytes") or name in {o[:-6] for o in DEPRECATED}, name
    exported = {n + {"counter": "_total", "info": "_info"}.get(f.type, "") for n, f in fams.items()}
    assert documented() == exported - set(DEPRECATED), (documented() ^ (exported - set(DEPRECATED)))
    for old, new in DEPRECATED.items():  # kept one release, same value
        assert s[(old, ())] == s[(new, ())] > 0
    assert s[("syncd_engine_version", (("engine", "e0"),))] == 5 and s[("syncd_newest_version", ())] == 5
    # the rebuild is counted apart: one rebuild observation, the pauses and lags are the live updates'
    rebuilds = s[("syncd_rebuilds_total", (("engine", "e0"),))]
    applied = s[("syncd_versions_applied_total", (("engine", "e0"),))]
    assert rebuilds == 1 and s[("syncd_rebuild_seconds_count", ())] == 1
    assert s[("syncd_pause_seconds_count", ())] == s[("syncd_update_lag_seconds_count", ())] == applied - rebuilds > 0
    # every series the dashboard queries is exported here (or is the cluster layer's, named in docs/cli.md)
    dash = json.loads((DOCS / "grafana-syncd.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    queried = {re.sub(r"_(bucket)$", "", m) for e in exprs for m in re.findall(r"\bsyncd_[a-z0-9_]+", e)}
    readme = (DOCS / "cli.md").read_text()
    for name in queried:
        assert name in exported or (name.startswith("syncd_cluster_") and name in readme), name
