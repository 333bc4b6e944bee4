"""vLLM under Dynamo records replay: a node of two ``--engine vllm --replay-store`` workers (a tiny Qwen2 with head_dim
64), the frontend and a sandbox proxy. The trainer's ``read_rollouts`` joins the engines' records with the proxy's
trajectories token by token (ids, versions, log-probs, kept sets) -- also for a stream that migrated to the other
worker when its first one stopped (paced by ``tests/dynamo/_paced_vllm.py`` until the client has its first
tokens, then SIGTERM, a 0.2 s drain timeout: the worker flushes its records and exits). A store that refuses the
records costs nothing: they are spilled and written once it takes them, and the requests are served meanwhile.
Replay settings vLLM cannot record are refused with HTTP 400 naming the field, as is replay asked
(``nvext.annotations: ["syncd.replay"]``) of a worker without a replay store."""

from __future__ import annotations

import os
import signal
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from syncd.engine.dynamo.serve import Node, NodeConfig
from syncd.engine.dynamo.settings import DynamoSettings
from syncd.procs import wait_until
from tests.dynamo._client import finish_reason, post_json, post_stream
from tests.dynamo._pacing import paced_stream, worker_env
from tests.dynamo.conftest import RUN_ID, start_proxy

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SANDBOX = "sb-vllm"
SIZES = dict(hidden=128, heads=2, kv_heads=1, intermediate=256)  # vLLM's CPU attention needs head_dim 64


@dataclass
class VLLMCluster:
    node: Node
    proxy: object
    store: Path
    spill: Path
    model: str
    hold: Path  # the workers' vLLM is paced while it exists

    def finish(self, tid: str) -> None:
        status, _, reply = post_json(f"{self.proxy.url}/syncd/trajectories/{tid}/finish", {})
        assert status == 200 and reply["written"], reply

    def rollout(self, tid: str):
        from syncd.trainer.rl.rollouts import read_rollouts

        rs = read_rollouts(str(self.store), RUN_ID, trajectories=[(SANDBOX, tid)])
        assert not rs.dropped and len(rs.rollouts) == 1
        return rs.rollouts[0]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from syncd.engine.reference.make_tiny import write_model

    if os.environ.get("SYNCD_VLLM") == "off":
        pytest.skip("SYNCD_VLLM=off: the vllm extra is not installed on this machine")
    root = tmp_path_factory.mktemp("vllm-cluster")
    model = write_model(root / "tiny", arch="qwen2", seed=5, max_positions=8192, **SIZES)
    store, spill = root / "store", root / "spill"
    blocked = store / "runs" / RUN_ID / "replay"
    blocked.parent.mkdir(parents=True)
    blocked.write_text("a file where the replay folder goes: the store refuses every replay chunk")
    cfg = NodeConfig(model=model, run_dir=root / "node", workers=2, frontend=True, migration_limit=3,
                     settings=DynamoSettings(file_kv=root / "kv", namespace=f"v{uuid.uuid4().hex[:8]}"),
                     worker_args=("--engine", "vllm", "--max-model-len", "8192", "--weights-version", "0",
                                  "--replay-store", store.resolve().as_uri(), "--run-id", RUN_ID,
                                  "--replay-spill-dir", str(spill), "--drain-timeout", "0.2"),
                     worker_env=worker_env(root / "plugins", root / "hold"), startup_timeout_s=420)
    node = Node(cfg).start()
    node.supervise(background=True)
    proxy = None
    try:
        proxy = start_proxy(root, node.frontend_url, store.resolve().as_uri(), SANDBOX)
        yield VLLMCluster(node, proxy, store, spill, cfg.model_name, root / "hold")
    finally:
        if proxy is not None:
            proxy.stop()
        node.close()


def _store_takes_records(c) -> None:
    """Undo the fixture's refusing store (idempotent): the workers' retries then write what they spilled. The first
    test does it after its check; the others call it too, so that each also runs alone."""
    blocked = c.store / "runs" / RUN_ID / "replay"
    if blocked.is_file():
        blocked.unlink()
        blocked.mkdir()


def _spilled(spill: Path) -> list[Path]:
    return sorted(spill.rglob("*.srpl")) if spill.exists() else []


def _check_joined(rollout, trajectory_tokens: int) -> None:
    """Every generated token of the rollout has its record: a kept set that holds it and the engine's log-prob."""
    [seq] = rollout.sequences
    gen = int(seq.loss_mask.sum())
    assert gen == trajectory_tokens and seq.kept_pending is None
    targets = seq.tokens[seq.positions]
    for g in range(gen):
        kept = seq.kept_ids[seq.kept_offsets[g]:seq.kept_offsets[g + 1]]
        assert int(targets[g]) in kept.tolist()
    assert (seq.versions[seq.positions] == 0).all() and (seq.logprobs[seq.positions] <= 0).all()


def test_a_store_refusing_records_loses_none_and_serves_the_requests(cluster):
    c = cluster
    tid = f"spill-{uuid.uuid4().hex[:6]}"
    body = {"model": c.model, "prompt": "the store is down", "max_tokens": 16, "temperature": 0.9, "top_p": 0.9,
            "ignore_eos": True}
    status, _, events = post_stream(f"{c.proxy.url}/v1/completions", body, headers={"X-Syncd-Trajectory": tid})
    assert status == 200 and finish_reason(events) == "length"  # served while nothing can be recorded
    wait_until(lambda: _spilled(c.spill), 60, "the refused replay chunk to be spilled")
    _store_takes_records(c)
    wait_until(lambda: not _spilled(c.spill), 60, "the spilled chunks to be written and removed")
    c.finish(tid)
    _check_joined(c.rollout(tid), 16)


def test_trajectories_join_the_vllm_records(cluster):
    c = cluster
    _store_takes_records(c)
    tid = f"join-{uuid.uuid4().hex[:6]}"
    hdr = {"X-Syncd-Trajectory": tid}
    first = {"model": c.model, "prompt": "one two three", "max_tokens": 12, "temperature": 0.8, "top_p": 0.8,
             "top_k": 40, "seed": 3, "ignore_eos": True, "nvext": {"annotations": ["syncd.replay"]}}
    status, _, events = post_stream(f"{c.proxy.url}/v1/completions", first, headers=hdr)
    assert status == 200 and finish_reason(events) == "length"
    chat = {"model": c.model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 10,
            "temperature": 1.0, "top_p": 0.5, "ignore_eos": True}
    status, _, events = post_stream(f"{c.proxy.url}/v1/chat/completions", chat, headers=hdr)
    assert status == 200 and finish_reason(events) == "length"
    c.finish(tid)
    rollout = wait_until(lambda: _joins(c, tid), 30, "the records of both turns")
    assert len(rollout.sequences) == 2  # the chat turn's prompt does not extend the completion: two sequences
    for seq, n in zip(rollout.sequences, (12, 10)):
        assert int(seq.loss_mask.sum()) == n


def _joins(c, tid):
    from syncd.trainer.rl.rollouts import MissingReplayError

    try:
        return c.rollout(tid)
    except MissingReplayError:  # the last chunk is written just after the stream ends
        return None


def test_a_migrated_trajectory_joins_the_records_of_both_workers(cluster):
    from syncd.records.trajectory import read_record

    c = cluster
    _store_takes_records(c)
    tid = f"mig-{uuid.uuid4().hex[:6]}"
    # paced, the workers make at most 20 tokens a second: the stream cannot end before the client has read its first
    # events however late it reads them, nor in the 0.2 s drain; unpaced, the other worker finishes it in seconds
    n = 2000
    body = {"model": c.model, "prompt": "a long story:", "max_tokens": n, "ignore_eos": True, "temperature": 1.0,
            "top_p": 0.95, "seed": 11, "nvext": {"extra_fields": ["worker_id"]}}
    workers = {w["instance_id"]: w for w in c.node.workers()}
    events: list = []
    result: list = []

    def run():
        try:
            result.append(post_stream(f"{c.proxy.url}/v1/completions", body, headers={"X-Syncd-Trajectory": tid},
                                      on_event=lambda i, ev: events.append(ev), timeout=300))
        except Exception as exc:  # noqa: BLE001 -- reported below
            result.append(exc)

    stream = threading.Thread(target=run, daemon=True)
    with paced_stream(c.hold, stream, lambda: len(events), 31, result):
        ids = {ev["nvext"]["worker_id"]["decode_worker_id"] for ev in events if "worker_id" in (ev.get("nvext") or {})}
        assert len(ids) == 1, (len(events), ids)
        os.kill(workers[ids.pop()]["pid"], signal.SIGTERM)  # drains 0.2 s, flushes its records, exits: it migrates
    stream.join(300)
    assert result and not isinstance(result[0], Exception), result
    [(status, _, got)] = result
    assert status == 200 and finish_reason(got) == "length"
    c.finish(tid)
    [turn] = read_record(str(c.store), RUN_ID, SANDBOX, tid)["turns"]
    assert len(turn["segments"]) >= 2 and turn["segments"][0]["count"] >= 30, "the stream did not migrate"
    rollout = wait_until(lambda: _joins(c, tid), 30, "the records of the migrated turn")
    _check_joined(rollout, n)


def test_replay_settings_vllm_cannot_record_get_400_naming_the_field(cluster, tmp_path):
    import asyncio

    from dynamo.llm.exceptions import InvalidArgument

    from syncd.engine.dynamo import worker
    from syncd.engine.reference.make_tiny import write_model

    c = cluster
    body = {"model": c.model, "prompt": "x", "max_tokens": 2}
    status, _, reply = post_json(f"{c.node.frontend_url}/v1/completions", {**body, "top_k": 100000})
    assert status == 400 and "top_k" in reply["message"], reply
    # a worker without a replay store refuses a request that needs records (the frontend passes
    # nvext.annotations on as the request's annotations)
    ref = worker.build_engine(worker.parser().parse_args(["--model", str(write_model(tmp_path / "m", seed=1)),
                                                          "--weights-version", "0"]))
    w = worker.DynamoWorker(ref, model_dir=tmp_path / "m", served_name="tiny", token="t" * 32)

    async def run(req):
        return [chunk async for chunk in w.generate(req)]

    try:
        with pytest.raises(InvalidArgument, match="syncd.replay: replay asked of a worker started without"):
            asyncio.run(run({"token_ids": [5, 6, 7], "stop_conditions": {"max_tokens": 2},
                             "annotations": ["syncd.replay"]}))
        assert len(asyncio.run(run({"token_ids": [5, 6, 7], "stop_conditions": {"max_tokens": 2}}))) == 2
    finally:
        ref.close()
