"""A real node with file discovery: the Dynamo frontend and two reference-engine workers started by
``syncd.engine.dynamo.serve.Node``, and per-sandbox proxies in front of it. One cluster serves the whole module
(startup costs 10-20 s on two cores); every test leaves it with two serving workers at weight version 0."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from syncd.procs import free_port, http_json, stop_process, wait_until
from syncd.engine.dynamo.node import Node, NodeConfig
from syncd.engine.dynamo.settings import DynamoSettings
from syncd.records.trajectory import read_record, replay_tokens
from syncd.engines.update import Update
from tests.dynamo._client import finish_reason, get_json, post_json, post_stream, stream_text
from tests.dynamo.conftest import RUN_ID, start_proxy

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LONG = {"ignore_eos": True, "temperature": 1.0}


@dataclass
class Cluster:
    node: Node
    proxy: object
    store_url: str
    root: Path
    model: str

    @property
    def frontend(self) -> str:
        return self.node.frontend_url

    def finish(self, tid: str) -> dict:
        """Finish a trajectory of the main proxy and read its record back from the store."""
        status, _, reply = post_json(f"{self.proxy.url}/syncd/trajectories/{tid}/finish", {})
        assert status == 200 and reply["written"], reply
        return read_record(self.store_url, RUN_ID, "sb-main", tid)

    def worker_by_name(self, name: str) -> dict:
        return next(w for w in self.node.workers() if w["name"] == name)

    def worker_of(self, instance_id: int) -> dict:
        return next(w for w in self.node.workers() if w["instance_id"] == instance_id)

    def wait_two_workers(self, timeout_s: float = 90.0) -> None:
        """Until both workers run, are visible through discovery and answer on their admin port."""
        from syncd.engines.client import RemoteAdapter

        def ready():
            ws = self.node.workers()
            if len(ws) != 2 or not self.node.serving():
                return False
            try:
                return all(RemoteAdapter(w["admin_url"], timeout_s=5).version == 0 for w in ws)
            except Exception:  # noqa: BLE001 -- still starting
                return False

        wait_until(ready, timeout_s, "both workers serving again")


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("cluster")
    store_url = (root / "store").resolve().as_uri()
    (root / "store").mkdir()
    cfg = NodeConfig(model=model_dir, run_dir=root / "node", workers=2, frontend=True, migration_limit=3,
                     settings=DynamoSettings(file_kv=root / "kv", namespace=f"t{uuid.uuid4().hex[:8]}"),
                     worker_args=("--weights-version", "0", "--replay-store", store_url, "--run-id", RUN_ID,
                                  "--drain-timeout", "30"),
                     startup_timeout_s=240, managed=False)  # no daemon here: a restarted worker serves version 0
    node = Node(cfg).start()
    node.supervise(background=True)
    proxy = None
    try:
        proxy = start_proxy(root, node.frontend_url, store_url, "sb-main")
        yield Cluster(node, proxy, store_url, root, cfg.model_name)
    finally:
        if proxy is not None:
            proxy.stop()
        node.close()


def _ids(events) -> list[int]:
    return [t for ev in events for t in ev["nvext"]["engine_data"]["token_ids"]]


# ---------------------------------------------------------------------------------------------- serving


def test_proxy_matches_direct_requests_and_records_them(cluster):
    c = cluster
    body = {"model": c.model, "prompt": "the cat sat on", "max_tokens": 12, "seed": 7, "temperature": 0.9}
    direct = {**body, "nvext": {"extra_fields": ["engine_data"]}}
    status, _, whole = post_json(f"{c.frontend}/v1/completions", direct)
    assert status == 200, whole
    _, _, streamed = post_stream(f"{c.frontend}/v1/completions", direct)
    assert stream_text(streamed, chat=False) == whole["choices"][0]["text"]
    direct_ids = _ids(streamed)
    assert len(direct_ids) == 12

    tid = f"agree-{uuid.uuid4().hex[:6]}"
    hdr = {"X-Syncd-Trajectory": tid}
    status, h, proxied = post_json(f"{c.proxy.url}/v1/completions", body, headers=hdr)
    assert status == 200 and h["X-Syncd-Trajectory"] == tid and h["X-Syncd-Turn"] == "0"
    assert proxied["choices"][0]["text"] == whole["choices"][0]["text"]
    assert "nvext" not in proxied  # the client did not ask for it
    status, _, events = post_stream(f"{c.proxy.url}/v1/completions", body, headers=hdr)
    assert status == 200 and stream_text(events, chat=False) == whole["choices"][0]["text"]
    assert all("nvext" not in ev for ev in events)
    chat = {"model": c.model, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 9,
            "temperature": 0}
    status, _, chat_events = post_stream(f"{c.proxy.url}/v1/chat/completions", chat, headers=hdr)
    assert status == 200 and finish_reason(chat_events) == "length"

    rec = c.finish(tid)
    assert rec["status"] == "complete" and rec["failure"] is None
    assert [t["endpoint"] for t in rec["turns"]] == ["completions", "completions", "chat/completions"]
    for turn in rec["turns"][:2]:
        assert turn["status"] == "ok" and turn["output_token_ids"] == direct_ids
        assert turn["versions"] == [0] * 12 and len(turn["logprobs"]) == 12
        assert turn["usage"]["prompt_tokens"] == len(turn["prompt_token_ids"]) > 0
        assert turn["text"] == whole["choices"][0]["text"]
    chat_turn = rec["turns"][2]
    assert chat_turn["text"] == stream_text(chat_events, chat=True) and len(chat_turn["output_token_ids"]) == 9
    assert chat_turn["request"] == {**chat, "stream": True}
    # the engines' replay records are linked by request id and agree token by token
    for turn in rec["turns"]:
        want = {i: (t, v) for i, (t, v) in enumerate(zip(turn["output_token_ids"], turn["versions"]))}
        wait_until(lambda: replay_tokens(c.store_url, RUN_ID, turn) == want, 30, "replay records of the turn")


def test_max_tokens_stop_tokens_and_unsupported_options(cluster):
    c = cluster
    base = {"model": c.model, "prompt": "stop here", "temperature": 0, "nvext": {"extra_fields": ["engine_data"]}}
    _, _, events = post_stream(f"{c.frontend}/v1/completions", {**base, "max_tokens": 10, "ignore_eos": True})
    assert len(_ids(events)) == 10 and finish_reason(events) == "length"
    _, _, events = post_stream(f"{c.frontend}/v1/completions", {**base, "max_tokens": 10})
    greedy = _ids(events)  # may end early at the model's EOS
    _, _, events = post_stream(f"{c.frontend}/v1/completions", {**base, "max_tokens": 3})
    assert _ids(events) == greedy[:3] and finish_reason(events) == "length"
    # (with ignore_eos the frontend drops every stop condition, so stop tokens are tested without it)
    i = next(i for i in range(1, len(greedy)) if greedy[i] not in greedy[:i])
    _, _, events = post_stream(f"{c.frontend}/v1/completions", {**base, "max_tokens": 10, "stop_token_ids": [greedy[i]]})
    assert _ids(events) == greedy[:i + 1] and finish_reason(events) == "stop"
    # options the engine cannot honour are refused, never ignored, and the client is told which
    status, _, reply = post_json(f"{c.frontend}/v1/completions", {**base, "max_tokens": 4, "presence_penalty": 1.5})
    assert status == 400 and reply["message"] == "this engine does not support presence_penalty=1.5", reply


def test_sigkill_mid_stream_migrates_and_matches_the_undisturbed_run(cluster):
    c = cluster
    body = {"model": c.model, "prompt": "a long story:", "max_tokens": 400, "seed": 11, **LONG}
    tid = f"mig-{uuid.uuid4().hex[:6]}"
    status, _, calm = post_stream(f"{c.proxy.url}/v1/completions", body, headers={"X-Syncd-Trajectory": tid})
    assert status == 200 and finish_reason(calm) == "length"

    killed = {}

    def kill_at(i, ev):
        if i == 40:
            w = c.worker_of(ev["nvext"]["worker_id"]["decode_worker_id"])
            killed.update(w)
            os.kill(w["pid"], signal.SIGKILL)

    status, _, hurt = post_stream(f"{c.proxy.url}/v1/completions",
                                  {**body, "nvext": {"extra_fields": ["worker_id"]}},
                                  headers={"X-Syncd-Trajectory": tid}, on_event=kill_at)
    assert killed, "the stream ended before the worker could be killed"
    assert status == 200 and finish_reason(hurt) == "length"
    assert stream_text(hurt, chat=False) == stream_text(calm, chat=False)

    rec = c.finish(tid)
    undisturbed, migrated = rec["turns"]
    assert rec["status"] == "complete"
    assert migrated["output_token_ids"] == undisturbed["output_token_ids"] and len(migrated["output_token_ids"]) == 400
    assert len(migrated["segments"]) >= 2 and migrated["segments"][0]["count"] >= 40
    assert len(undisturbed["segments"]) == 1
    # the surviving worker's replay records agree with the trajectory for the tokens it made
    last = migrated["segments"][-1]
    tail = range(last["start"], last["start"] + last["count"])
    want = {i: (migrated["output_token_ids"][i], 0) for i in tail}
    wait_until(lambda: all(replay_tokens(c.store_url, RUN_ID, migrated).get(i) == want[i] for i in tail), 30,
               "replay records of the migrated segment")
    # the supervisor brings the killed worker back
    wait_until(lambda: c.worker_by_name(killed["name"])["restarts"] > killed["restarts"], 60,
               "the killed worker to be restarted")
    c.wait_two_workers()


def test_sigterm_leaves_discovery_at_once_and_drains(cluster):
    c = cluster
    body = {"model": c.model, "prompt": "drain me", "max_tokens": 600, "seed": 5, **LONG,
            "nvext": {"extra_fields": ["worker_id", "engine_data"]}}
    stopped = {}
    others = []

    def stop_at(i, ev):
        if i == 20:
            w = c.worker_of(ev["nvext"]["worker_id"]["decode_worker_id"])
            stopped.update(w)
            os.kill(w["pid"], signal.SIGTERM)
            t0 = time.monotonic()
            # new requests from the signal on: every one served (one that reaches the stopping worker before its
            # handler has run is drained), and within a few seconds they all land elsewhere -- on a busy
            # machine the handler may run a little late, but well before the 10 s lease a SIGKILL would leave
            while time.monotonic() - t0 < 8 and not (len(others) >= 4 and all(o[2] != w["instance_id"]
                                                                                for o in others[-4:])):
                s, _, r = post_json(f"{c.frontend}/v1/completions",
                                    {"model": c.model, "prompt": "x", "max_tokens": 2,
                                     "nvext": {"extra_fields": ["worker_id"]}})
                wid = r["nvext"]["worker_id"]["decode_worker_id"] if s == 200 else r
                others.append((time.monotonic() - t0, s, wid))

    status, _, events = post_stream(f"{c.frontend}/v1/completions", body, on_event=stop_at)
    assert stopped and status == 200 and finish_reason(events) == "length"
    assert len(events) == 600
    assert all(s == 200 for _, s, _ in others), others
    assert len(others) >= 4 and all(wid != stopped["instance_id"] for _, _, wid in others[-4:]), others
    assert others[-4][0] < 5.0, others  # the first of those four was sent within 5 s of the signal
    # the stream drained on the stopping worker: one engine request, no migration (which restarts the index)
    assert [ev["nvext"]["engine_data"]["index"] for ev in events] == list(range(600))
    assert len({ev["nvext"]["engine_data"]["request_id"] for ev in events}) == 1
    wait_until(lambda: c.worker_by_name(stopped["name"])["restarts"] > stopped["restarts"], 60,
               "the stopped worker to exit and be restarted")
    c.wait_two_workers()


# ---------------------------------------------------------------------------------------------- weights


def _publish(model_dir: Path, store_url: str) -> None:
    """Version 0 = the folder's weights (full), version 1 = after one real AdamW step (a delta)."""
    from transformers import AutoModelForCausalLM

    from tests.store._models import train_steps
    from syncd.trainer import WeightPublisher

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with WeightPublisher(store_url, RUN_ID, signing_key=False) as pub:
        pub.publish(model, 0)
        pub.flush()
        train_steps(model, 1, lr=1e-3)
        pub.publish(model, 1)


def test_weight_update_through_admin_routes_while_streaming(cluster, model_dir):
    from syncd.engines.client import RemoteAdapter
    from syncd import manifest as mf
    from syncd.cache import ShardCache
    from syncd.versions import cache_version

    c = cluster
    _publish(model_dir, c.store_url)
    cache_root = c.root / "cache"
    # the shards of both versions in a node cache (contract 2)
    raw0, raw1 = (cache_version(c.store_url, RUN_ID, v, ShardCache(cache_root), signing_key=False) for v in (0, 1))
    want1 = {t.name: t.checksum for t in mf.parse(raw1, key=None).tensors}
    want0 = {t.name: t.checksum for t in mf.parse(raw0, key=None).tensors}
    engines = [RemoteAdapter(w["admin_url"]) for w in c.node.workers()]
    assert all(e.checksum() == want0 for e in engines), "workers do not start from version 0's weights"

    tid = f"upd-{uuid.uuid4().hex[:6]}"
    results: list = [None] * 4
    progress = [0] * 4

    def run(k):
        body = {"model": c.model, "prompt": f"stream {k}", "max_tokens": 700, "seed": k, **LONG}
        results[k] = post_stream(f"{c.proxy.url}/v1/completions", body, headers={"X-Syncd-Trajectory": tid},
                                 on_event=lambda i, ev: progress.__setitem__(k, i + 1))

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    wait_until(lambda: min(progress) >= 10, 60, "all four streams to be under way")
    for e in engines:  # what the node daemon does, through the workers' admin routes
        e.stage(Update.from_cache(raw1, cache_root))
        e.pause()
        e.apply()
        assert e.version == 1 and e.checksum() == want1
        e.resume()
    for t in threads:
        t.join(120)

    rec = c.finish(tid)
    assert rec["status"] == "complete", rec["failure"]
    switched = 0
    for turn in rec["turns"]:
        v = turn["versions"]
        assert len(v) == 700 and set(v) <= {0, 1}
        assert v == sorted(v), "versions in a stream must switch once, from 0 to 1"
        switched += (v[0], v[-1]) == (0, 1)
    assert switched >= 1, "no stream was running across the update"
    assert all(status == 200 and finish_reason(ev) == "length" for status, _, ev in results)

    # a bad update is refused and changes nothing; rollback restores version 0 bit for bit
    # (Dynamo's system server answers a failed route with HTTP 500 and the exception in "message")
    status, reply = http_json("POST", f"{engines[0].base_url}/engine/weights/stage",
                              {"manifest": '{"schema":"nope"}', "cache_root": str(cache_root),
                               **engines[0].credentials()})
    assert status == 500 and "ManifestError" in reply["message"], reply
    from syncd.errors import LeaseHeld, ManifestError, NotAuthorized

    with pytest.raises(ManifestError):  # RemoteAdapter recovers the type from Dynamo's envelope
        engines[0].call("stage", {"manifest": '{"schema":"nope"}', "cache_root": str(cache_root)})
    # the weight routes need the node's engine token (in the body: Dynamo hands a route only its body) and,
    # for weight ops, the lease, which engines[0] holds
    status, reply = http_json("POST", f"{engines[0].base_url}/engine/weights/pause", {})
    assert status == 500 and "NotAuthorized" in reply["message"], reply
    with pytest.raises(NotAuthorized):
        RemoteAdapter(engines[0].base_url, token="0" * 64).version
    with pytest.raises(LeaseHeld, match=f"pid {os.getpid()}"):
        RemoteAdapter(engines[0].base_url, run_id="other").pause()
    assert engines[0].version == 1 and engines[0].checksum() == want1
    for e in engines:
        e.pause()
        e.rollback()
        e.resume()
        assert e.version == 0 and e.checksum() == want0


# ---------------------------------------------------------------------------------------------- proxy


def test_proxy_retries_until_the_frontend_comes_up(cluster):
    c = cluster
    port = free_port()
    proxy = start_proxy(c.root / "retry", f"http://127.0.0.1:{port}", c.store_url, "sb-retry",
                        "--retry-attempts", "12", "--retry-deadline", "90")
    frontend = None
    try:
        box = {}
        t = threading.Thread(target=lambda: box.update(r=post_json(
            f"{proxy.url}/v1/completions", {"model": c.model, "prompt": "late", "max_tokens": 5, "seed": 1},
            headers={"X-Syncd-Trajectory": "late"})))
        t.start()
        time.sleep(1.0)  # the first attempts find nothing listening
        import subprocess
        import sys

        frontend = subprocess.Popen([sys.executable, "-m", "syncd.engine.dynamo.frontend", "--http-port", str(port),
                                     *c.node.settings.argv()], env=c.node.settings.environ(),
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        t.join(120)
        status, _, reply = box["r"]
        assert status == 200 and reply["choices"][0]["finish_reason"] == "length"
        status, _, _ = post_json(f"{proxy.url}/syncd/trajectories/late/finish", {})
        rec = read_record(c.store_url, RUN_ID, "sb-retry", "late")
        turn = rec["turns"][0]
        assert rec["status"] == "complete" and len(turn["attempts"]) >= 2
        assert all(a["error"] for a in turn["attempts"][:-1]) and turn["attempts"][-1]["error"] is None
    finally:
        proxy.stop()
        if frontend is not None:
            stop_process(frontend, 10)


def test_proxy_marks_failures_and_never_truncates_silently(cluster):
    c = cluster
    proxy = start_proxy(c.root / "fail", c.frontend, c.store_url, "sb-fail", "--retry-attempts", "2",
                        "--retry-deadline", "5")
    try:
        # a client that goes away mid-stream: its turn keeps the tokens it got and fails the trajectory
        hdr = {"X-Syncd-Trajectory": "gone"}
        status, _, events = post_stream(f"{proxy.url}/v1/completions",
                                        {"model": c.model, "prompt": "bye", "max_tokens": 500, "seed": 2, **LONG},
                                        headers=hdr, stop_after=3)
        assert status == 200 and len(events) == 3
        wait_until(lambda: get_json(f"{proxy.url}/syncd/trajectories/gone")[1]["turns"][0]["status"] == "failed",
                   30, "the proxy to notice the client left")
        status, _, reply = post_json(f"{proxy.url}/syncd/trajectories/gone/finish", {"metadata": {"why": "test"}})
        assert status == 200 and reply["status"] == "failed" and "client went away" in reply["failure"]
        rec = read_record(c.store_url, RUN_ID, "sb-fail", "gone")
        assert rec["metadata"] == {"why": "test"} and len(rec["turns"][0]["output_token_ids"]) >= 3
        # a model the frontend does not serve: the client's mistake, the frontend's 404 at once (not retried)
        status, _, reply = post_json(f"{proxy.url}/v1/completions", {"model": "no-such-model", "prompt": "x"},
                                     headers={"X-Syncd-Trajectory": "nomodel"})
        assert (status, reply["message"]) == (404, "Model not found"), reply
        # finishing twice is refused; an unknown trajectory is a 404; bad ids are refused
        assert post_json(f"{proxy.url}/syncd/trajectories/gone/finish", {})[0] == 409
        assert post_json(f"{proxy.url}/syncd/trajectories/never/finish", {})[0] == 404
        assert post_json(f"{proxy.url}/v1/completions", {"model": c.model, "prompt": "x"},
                         headers={"X-Syncd-Trajectory": "../etc"})[0] == 400
    finally:
        assert proxy.stop() == 0
    # stopping the proxy wrote the trajectory still open, marked failed with the reason
    rec = read_record(c.store_url, RUN_ID, "sb-fail", "nomodel")
    assert rec["status"] == "failed" and "HTTP 404" in rec["failure"] and len(rec["turns"][0]["attempts"]) == 1
