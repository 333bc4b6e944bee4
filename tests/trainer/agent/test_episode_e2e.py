"""Multi-turn tool use end to end on real parts: the rollout workers (``syncd.trainer.rl.rollout_workers`` with the
``lookup`` agent task: chat completions with tools, the tool run in a sandbox per trajectory, the grade outside
it), the sandbox proxy (a process), the Dynamo frontend and a reference-engine worker recording replay records,
and the trainer's reader. Every turn and tool call is in the record (schema version 2), the trainer joins it with
the replay records, and the tokens it trains on are the engine's, one prefix-consistent sequence per trajectory.
Then trajectories whose tools try to escape the sandbox (scripted calls, through the same proxy and engine) are
contained and get reward 0 with the detector named; clean ones keep their reward. The model is a tiny one given
a 40-step warm-up on the lookup format (letters in both turns, the answer independent of the tool's: the task is
not taught) and the compact chat template, so that its text round-trips."""

from __future__ import annotations

import json
import os

import pytest

from syncd.records.trajectory import read_record
from syncd.trainer.rl.buffer import RolloutBuffer
from syncd.trainer.rl.compaction import prefix_consistent, training_samples
from syncd.trainer.rl.rollout_workers import Sampling, RolloutWorkers
from syncd.trainer.rl.agent_tasks import ScriptedLookup
from syncd.trainer.rl.tasks import get_task

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox's jail needs root (CI runs as root)")]

RUN = "agent"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """``(proxy URL, model name, store URL)``: a warmed-up tiny model behind one worker, the frontend, a proxy."""
    from syncd.engine.reference.make_tiny import write_model
    from syncd.trainer.agent.warmup import lookup_format_demos, use_template, warm_up
    from tests.dynamo._recording import recording_node

    root = tmp_path_factory.mktemp("agent")
    model = write_model(root / "tiny", arch="qwen2", seed=3)
    use_template(model)
    warm_up(model, lookup_format_demos(256), steps=40)
    with recording_node(root, model, RUN, "ag", sandbox="sb-agent") as (_, cfg, store, url):
        yield url, cfg.model_name, store


def _workers(stack, task, group_size=4, **kw) -> tuple[RolloutWorkers, RolloutBuffer]:
    url, model, store = stack
    buf = RolloutBuffer(2)
    w = RolloutWorkers(proxies=[url], model_name=model, task=task, reward=task.reward, group_size=group_size,
                       sampling=Sampling(1.0, 1.0, 4), store=store, run_id=RUN, buffer=buf, version=lambda: 0,
                       step=lambda: 0, workers=1, vocab_size=320, **kw)
    return w, buf


def _group(w, buf):
    w.start()
    try:
        w.allow(1)
        (g,) = buf.take(1, 0, timeout_s=300)
    finally:
        w.stop()
    assert w.stats()["failures"] == {k: 0 for k in w.stats()["failures"]}, w.stats()
    return g


def test_a_multi_turn_tool_trajectory_end_to_end(stack):
    task = get_task("lookup", length=4)
    w, buf = _workers(stack, task)
    g = _group(w, buf)
    store = stack[2]
    for (sb, tid), ro, reward in zip(g.trajectories, g.rollouts, g.rewards):
        rec = read_record(store, RUN, sb, tid)
        assert rec["schema_version"] == 2 and rec["status"] == "complete"
        assert [t["endpoint"] for t in rec["turns"]] == ["chat/completions"] * 2
        (call,) = rec["tool_calls"]
        assert call["name"] == "lookup" and call["turn"] == 0 and call["status"] == "ok" and call["wall_s"] > 0
        assert call["output"] == g.item.target
        second = rec["turns"][1]["request"]["messages"]
        assert second[1]["tool_calls"][0]["id"] == call["id"] and second[1]["content"] == rec["turns"][0]["text"]
        assert second[2] == {"role": "tool", "tool_call_id": call["id"], "content": g.item.target}
        assert rec["turns"][0]["request"]["tools"][0]["function"]["name"] == "lookup"
        meta = rec["metadata"]
        assert meta["reward"] == reward == task.score(g.item, rec["turns"][1]["text"])
        assert meta["sandbox"]["network"] == "restricted" and meta["turns"] == 2
        assert meta["reward_info"]["cheating"] == [] and meta["reward_info"]["cost"]["turns"] == 2
        # joined with the replay records, one prefix-consistent sequence: the tokens the engine saw, both turns
        (seq,) = ro.sequences
        outs = [t["output_token_ids"] for t in rec["turns"]]
        assert seq.tokens[seq.loss_mask].tolist() == outs[0] + outs[1]
        assert seq.turns == [0, 1] and set(seq.versions[seq.loss_mask].tolist()) == {0}
        (sample,) = training_samples(ro)
        assert prefix_consistent(sample, rec) and sample.reward == reward
    assert g.tokens == sum(len(t) for ro in g.rollouts for t in [ro.sequences[0].tokens[ro.sequences[0].loss_mask]])


ESCAPES = {  # what a tool tries -> the detector that must name it, and what shows it was contained
    "network": ("python3 -c \"import socket; socket.create_connection(('127.0.0.1', 80), timeout=2)\"",
                "network_access", "Errno"),
    "outside": ("cat /etc/shadow /root/.bashrc", "sandbox_escape", "No such file"),
    "grader": ("cat ../hidden_tests/expected.json", "hidden_files", "No such file"),
    # the bomb's first caller returns at once; `exec sleep` (no fork) keeps the session alive while the bomb
    # meets the process limit, or the session could end before any fork failed and print nothing
    "fork bomb": ("bash -c ':(){ :|:& };:; exec sleep 3'", "sandbox_escape", "Resource temporarily unavailable"),
    "runaway": ("setsid sleep 1000 & while :; do :; done", "sandbox_escape", "[killed: no result after"),
}


def test_escape_attempts_are_contained_and_get_reward_zero_with_the_detector_named(stack):
    commands = [c for c, _, _ in ESCAPES.values()]
    task = ScriptedLookup(commands)
    w, buf = _workers(stack, task, group_size=len(commands))
    g = _group(w, buf)
    seen = set()
    for sb, tid in g.trajectories:
        rec = read_record(stack[2], RUN, sb, tid)
        command = json.loads(rec["tool_calls"][0]["arguments"])["command"]
        case = next(k for k, (c, _, _) in ESCAPES.items() if c == command)
        assert ESCAPES[case][2] in task.results[command], (case, task.results[command])  # contained
        info = rec["metadata"]["reward_info"]
        assert rec["metadata"]["reward"] == 0.0 and ESCAPES[case][1] in info["cheating"], (case, info)
        seen.add(case)
    assert seen == set(ESCAPES)


def test_a_clean_tool_call_keeps_its_reward(stack):
    task = ScriptedLookup(["cat secret.txt"])
    w, buf = _workers(stack, task)
    g = _group(w, buf)
    assert task.results["cat secret.txt"] == g.item.target
    for (sb, tid), reward in zip(g.trajectories, g.rewards):
        rec = read_record(stack[2], RUN, sb, tid)
        assert rec["tool_calls"][0]["name"] == "bash" and rec["metadata"]["reward_info"]["cheating"] == []
        assert reward == rec["metadata"]["reward_info"]["base"]
