"""Proxy records are never lost: real ``python -m syncd.engine.proxy`` processes in front of a real Dynamo frontend
and reference-engine worker, writing to a real file store.

* a client body with values strict JSON cannot hold (NaN, Infinity, 1e999, deep nesting) or malformed
  members the proxy reads is refused with a 400 before any turn exists; the trajectory's record holds
  exactly the turns that were served;
* a proxy restarted with the same sandbox id never collides with the records of its earlier life: the
  default trajectory id is unique per life, and a client's id whose key is taken is written renamed;
* a record the store will not take is spilled at once and the other records are written all the same."""

from __future__ import annotations

import http.client
import json
import signal
from urllib.parse import urlsplit

import pytest

from syncd.procs import wait_until
from syncd.records.trajectory import list_records, parse, read_record
from tests.dynamo._client import get_json, post_json
from tests.dynamo.conftest import RUN_ID, start_proxy

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def frontend(tmp_path_factory):
    """``(frontend URL, model name, store URL, workdir)`` of one node: a frontend and one worker."""
    from syncd.engine.reference.make_tiny import write_model
    from tests.dynamo._recording import recording_node

    root = tmp_path_factory.mktemp("proxy-records")
    model = write_model(root / "tiny", arch="qwen2", seed=3)
    with recording_node(root, model, RUN_ID, "t") as (node, cfg, store, _):
        yield node.frontend_url, cfg.model_name, store, root


def post_raw(url: str, raw: bytes, headers: dict) -> tuple[int, dict]:
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    try:
        conn.request("POST", u.path, body=raw, headers={"Content-Type": "application/json", **headers})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null")
    finally:
        conn.close()


def completion(proxy, model: str, tid: str | None, prompt: str) -> dict:
    hdr = {"X-Syncd-Trajectory": tid} if tid else {}
    status, _, reply = post_json(f"{proxy.url}/v1/completions",
                                 {"model": model, "prompt": prompt, "max_tokens": 3, "seed": 1}, headers=hdr)
    assert status == 200, reply
    return reply


def test_invalid_json_values_are_refused_before_the_turn_is_served(frontend):
    upstream, model, store, root = frontend
    proxy = start_proxy(root / "bad", upstream, store, "sb-bad")
    try:
        good = {"model": model, "prompt": "fine", "max_tokens": 3, "seed": 1}
        ok = completion(proxy, model, "t-bad", "fine")
        hdr = {"X-Syncd-Trajectory": "t-bad"}
        bodies = [
            (b'{"model": "%s", "prompt": "x", "temperature": NaN}' % model.encode(), "NaN is not a JSON value"),
            (b'{"model": "m", "prompt": "x", "logit_bias": {"5": Infinity}}', "Infinity is not a JSON value"),
            (b'{"model": "m", "prompt": "x", "top_p": -Infinity}', "-Infinity is not a JSON value"),
            (b'{"model": "m", "prompt": "x", "temperature": 1e999}', "overflows to infinity"),
            (b'{"model": "m", "prompt": ' + b"[" * 4096 + b"]" * 4096 + b"}", "nested deeper than 64"),
            (json.dumps({**good, "nvext": {"extra_fields": [["x"]]}}).encode(), "nvext.extra_fields"),
            (json.dumps({**good, "stream_options": "yes"}).encode(), "stream_options"),
            (b"[1, 2]", "must be a JSON object"),
        ]
        for raw, why in bodies:
            status, reply = post_raw(f"{proxy.url}/v1/completions", raw, hdr)
            assert status == 400 and why in reply["error"]["message"], (raw[:80], status, reply)
        # nothing was recorded half-way: the open trajectory holds the one turn that was served
        status, doc = get_json(f"{proxy.url}/syncd/trajectories/t-bad")
        assert status == 200 and len(doc["turns"]) == 1 and doc["turns"][0]["status"] == "ok"
        # metadata the record cannot hold is refused too, and the trajectory stays open and unchanged
        status, reply = post_raw(f"{proxy.url}/syncd/trajectories/t-bad/finish", b'{"metadata": {"r": NaN}}', {})
        assert status == 400 and "NaN" in reply["error"]["message"]
        status, _, reply = post_json(f"{proxy.url}/syncd/trajectories/t-bad/finish", {"metadata": {"reward": 0.5}})
        assert status == 200 and reply["written"] and reply["status"] == "complete", reply
        health = get_json(f"{proxy.url}/health")[1]
        assert health["failures"] == {} and health["tasks"]["record retry"]["running"], health
    finally:
        assert proxy.stop() == 0
    rec = read_record(store, RUN_ID, "sb-bad", "t-bad")
    assert rec["metadata"] == {"reward": 0.5} and len(rec["turns"]) == 1
    turn = rec["turns"][0]
    assert turn["request"]["prompt"] == "fine" and turn["text"] == ok["choices"][0]["text"]
    assert len(turn["output_token_ids"]) == 3


def test_a_restart_with_the_same_sandbox_id_loses_nothing(frontend):
    upstream, model, store, root = frontend
    texts = {}
    for life, prompts in ((1, {None: "one", "t1": "two"}), (2, {None: "three", "t1": "four", "t2": "five"})):
        proxy = start_proxy(root / f"life{life}", upstream, store, "sb-restart")
        try:
            for tid, prompt in prompts.items():
                texts[prompt] = completion(proxy, model, tid, prompt)["choices"][0]["text"]
        finally:
            assert proxy.stop() == 0, proxy.log.read_text()[-3000:]  # stopping wrote every open trajectory
    records = {t: read_record(store, RUN_ID, "sb-restart", t) for _, t in list_records(store, RUN_ID, "sb-restart")}
    by_prompt = {rec["turns"][0]["request"]["prompt"]: (tid, rec) for tid, rec in records.items()}
    assert len(records) == 5 and sorted(by_prompt) == sorted(texts), sorted(records)
    for prompt, (tid, rec) in by_prompt.items():
        assert rec["status"] == "complete" and len(rec["turns"]) == 1, rec
        assert rec["turns"][0]["text"] == texts[prompt]
    assert by_prompt["one"][0].startswith("default-") and by_prompt["three"][0].startswith("default-")
    assert by_prompt["two"][0] == "t1" and by_prompt["five"][0] == "t2"
    renamed, rec = by_prompt["four"]  # the second life's t1: its key was taken by the first life's
    assert renamed.startswith("t1.") and rec["requested_trajectory_id"] == "t1"
    assert renamed.split(".", 1)[1] == by_prompt["three"][0].removeprefix("default-"), "both name the second life"


def test_a_record_the_store_refuses_is_spilled_at_once_and_the_others_are_written(frontend):
    upstream, model, store, root = frontend
    spill = root / "spill"
    # the store holds something unreadable at one trajectory's key (a directory): it can neither be created
    # there nor compared with
    blocked = root / "store" / "runs" / RUN_ID / "trajectories" / "sb-spill" / "t-blocked.json"
    blocked.mkdir(parents=True)
    proxy = start_proxy(root / "spilling", upstream, store, "sb-spill", "--spill-dir", str(spill),
                        "--close-timeout", "2")
    try:
        for tid in ("t-a", "t-blocked", "t-b"):
            completion(proxy, model, tid, tid)
        status, _, reply = post_json(f"{proxy.url}/syncd/trajectories/t-blocked/finish", {})
        assert status == 200 and reply["written"] is False, reply
        spilled = spill / "runs" / RUN_ID / "trajectories" / "sb-spill" / "t-blocked.json"
        assert parse(spilled.read_bytes())["trajectory_id"] == "t-blocked"  # on disk before the proxy stops
        health = get_json(f"{proxy.url}/health")[1]
        assert health["pending_writes"] == 1 and health["failures"]["store"] >= 1, health
        metrics = http.client.HTTPConnection(urlsplit(proxy.url).hostname, urlsplit(proxy.url).port, timeout=10)
        metrics.request("GET", "/metrics")
        assert 'syncd_failures_total{kind="store"}' in metrics.getresponse().read().decode()
        proxy.proc.send_signal(signal.SIGTERM)  # t-a and t-b are still open: written at stop
        wait_until(lambda: proxy.proc.poll() is not None, 60, "the proxy to stop")
        assert proxy.proc.returncode == 0
    finally:
        proxy.stop()
    assert {t for _, t in list_records(store, RUN_ID, "sb-spill")} >= {"t-a", "t-b"}
    for tid in ("t-a", "t-b"):
        assert read_record(store, RUN_ID, "sb-spill", tid)["turns"][0]["request"]["prompt"] == tid
    assert parse(spilled.read_bytes())["turns"][0]["request"]["prompt"] == "t-blocked"
    assert "saved in" in proxy.log.read_text()
