"""The daemon, the trainer and the engines as separate processes on the file store, killed and cut off
at the worst moments. Every test ends with the engine's checksums equal to the trainer's own."""

from __future__ import annotations

import os
import signal

import pytest

from tests.daemon._procs import (engine_checksums, engine_version, generate, kill9, metric, open_gates, status,
                                 status_at, trainer_record)

pytestmark = [pytest.mark.integration, pytest.mark.slow]




def same_as_trainer(url: str, record, version: int) -> bool:
    return engine_checksums(url) == trainer_record(record)[version]["checksums"]


def test_daemon_killed_mid_download_and_mid_stage_converges(tmp_path, procs, model_dir):
    store, cache, gates, marks, record = (tmp_path / n for n in ("store", "cache", "gates", "marks", "rec.jsonl"))
    marks.mkdir()
    open_gates(gates, 0, 1, 2)
    procs.trainer(store, model_dir, 7, gate_dir=gates, record=record)
    _, url = procs.engine(model_dir, headless=True)

    a = procs.daemon(store, cache, [url], hooks="download@3", mark_dir=marks)
    procs.wait(lambda: engine_version(url) == 2, "the engine rebuilt at version 2")
    open_gates(gates, 3)
    procs.wait(lambda: (marks / "download").exists(), "daemon A to hold mid-download of version 3")
    kill9(a)
    assert any(cache.joinpath("tmp").iterdir()), "a half-written shard should be left by the kill"
    assert engine_version(url) == 2

    b = procs.daemon(store, cache, [url], hooks="stage@4", mark_dir=marks)
    procs.wait(lambda: engine_version(url) == 3, "daemon B to continue to version 3")
    assert not any(cache.joinpath("tmp").iterdir()), "daemon B cleans the half-written shard"
    open_gates(gates, 4)
    procs.wait(lambda: (marks / "stage").exists(), "daemon B to hold with version 4 staged")
    kill9(b)
    assert engine_version(url) == 3 and same_as_trainer(url, record, 3)

    open_gates(gates, 5)
    c = procs.daemon(store, cache, [url], hooks="apply@6:3", mark_dir=marks)
    procs.wait(lambda: engine_version(url) == 5, "daemon C to converge to version 5")
    assert same_as_trainer(url, record, 5)
    st = status_at(procs, cache, 5)
    assert st["engines"]["e0"]["state"] == "serving" and st["newest_version"] == 5
    assert all(u["version"] != 4 or u.get("rebuild_from") is None for u in st["updates"])

    # SIGTERM while an engine is paused mid-update: the update is finished and verified, then the daemon exits
    open_gates(gates, 6)
    procs.wait(lambda: (marks / "apply").exists(), "daemon C to hold inside the update of version 6")
    c.send_signal(signal.SIGTERM)
    assert c.wait(timeout=60) == 0, procs.logs()
    assert engine_version(url) == 6 and same_as_trainer(url, record, 6)
    assert status(cache)["state"] == "stopped"


def test_engine_killed_comes_back_on_the_right_version(tmp_path, procs, model_dir):
    from tests.daemon.conftest import free_port

    store, cache, record = tmp_path / "store", tmp_path / "cache", tmp_path / "rec.jsonl"
    trainer = procs.trainer(store, model_dir, 3, record=record)
    port = free_port()
    engine, url = procs.engine(model_dir, port=port)
    procs.daemon(store, cache, [url])
    assert trainer.wait(timeout=120) == 0, procs.logs()
    procs.wait(lambda: engine_version(url) == 2, "the engine at version 2")
    assert same_as_trainer(url, record, 2)
    assert {t["version"] for t in generate(url)} == {2}

    kill9(engine)
    procs.engine(model_dir, port=port)  # a new engine process, on its initial weights (no version)
    procs.wait(lambda: engine_version(url) == 2 and metric(cache, 'syncd_rebuilds_total{engine="e0"}') == 2,
               "the restarted engine rebuilt at version 2")
    assert same_as_trainer(url, record, 2)
    assert {t["version"] for t in generate(url)} == {2}


def test_store_outage_engines_keep_serving_then_the_daemon_catches_up(tmp_path, procs, model_dir):
    store, cache = tmp_path / "store", tmp_path / "cache"
    rec1, rec2 = tmp_path / "rec1.jsonl", tmp_path / "rec2.jsonl"
    assert procs.trainer(store, model_dir, 2, record=rec1).wait(timeout=120) == 0, procs.logs()
    _, url = procs.engine(model_dir)
    procs.daemon(store, cache, [url])
    procs.wait(lambda: engine_version(url) == 1, "the engine at version 1")

    away = tmp_path / "store-away"
    os.rename(store, away)  # the node loses the store: every request to it fails
    store.write_bytes(b"")
    procs.wait(lambda: metric(cache, "syncd_poll_errors_total") >= 3, "the daemon to see the outage")
    procs.wait(lambda: status(cache)["store_error"], "the status file to show the store error")
    # meanwhile the trainer side still reaches the store and publishes two more versions
    assert procs.trainer(away, model_dir, 2, record=rec2, extra=["--seed", "1"]).wait(timeout=120) == 0
    events = generate(url, max_tokens=4)
    assert {e["version"] for e in events} == {1} and events[-1]["finish_reason"] == "length"
    assert engine_version(url) == 1 and same_as_trainer(url, rec1, 1)

    store.unlink()
    os.rename(away, store)  # back
    procs.wait(lambda: engine_version(url) == 3, "the daemon to catch up to version 3")
    assert same_as_trainer(url, rec2, 3)
    procs.wait(lambda: status(cache)["store_error"] is None, "the store error to clear")


def test_corrupt_shard_and_bad_signature_are_rejected(tmp_path, procs, model_dir):
    store, cache, gates, record = tmp_path / "store", tmp_path / "cache", tmp_path / "gates", tmp_path / "rec.jsonl"
    open_gates(gates, 0, 1, 2, 3)
    procs.trainer(store, model_dir, 10, gate_dir=gates, record=record,
                  extra=["--tamper", "corrupt@4", "--tamper", "badsig@7"])  # fulls at 0, 3, 6, 9
    _, url = procs.engine(model_dir, headless=True)
    procs.daemon(store, cache, [url])
    procs.wait(lambda: engine_version(url) == 3, "version 3")

    open_gates(gates, 4)
    procs.wait(lambda: metric(cache, 'syncd_rejected_versions_total{reason="integrity"}') >= 1,
               "the corrupt version 4 to be rejected")
    assert engine_version(url) == 3 and same_as_trainer(url, record, 3)
    open_gates(gates, 5, 6)  # 5 builds on the rejected 4; 6 is a full version
    procs.wait(lambda: engine_version(url) == 6, "version 6 past the rejected chain")
    assert same_as_trainer(url, record, 6)

    open_gates(gates, 7)
    procs.wait(lambda: metric(cache, 'syncd_rejected_versions_total{reason="signature"}') >= 1,
               "the forged version 7 to be rejected")
    assert engine_version(url) == 6 and same_as_trainer(url, record, 6)
    open_gates(gates, 8, 9)
    procs.wait(lambda: engine_version(url) == 9, "version 9")
    assert same_as_trainer(url, record, 9)
    applied = procs.wait(lambda: (a := {u["version"] for u in status(cache)["updates"]}) and 9 in a and a,
                         "the status file to record version 9")
    assert applied.isdisjoint({4, 5, 7, 8}) and {3, 6, 9} <= applied
    assert metric(cache, 'syncd_failures_total{kind="integrity"}') >= 1
    assert metric(cache, 'syncd_failures_total{kind="signature"}') >= 1
