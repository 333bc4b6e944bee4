"""A bugfix and a detect episode with a scripted agent (the chat replies are given; no engine): the tool-execution
loop (``syncd.trainer.agent.episode``) parses the calls of either syntax, runs them in the task's sandbox, appends
the tool messages, posts the calls for the record; the final state is graded on the grader's copy, and the
task's reward stack scores it on the record."""

from __future__ import annotations

import json
import os

import pytest

from syncd.trainer.agent.envs import parse_tool_calls
from syncd.trainer.rl.tasks import Sample, get_task

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox's jail needs root (CI runs as root)")


def _reply(content="", calls=()):
    msg = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = [{"id": f"x{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
                             for i, (n, a) in enumerate(calls)]
    return {"choices": [{"message": msg, "finish_reason": "stop"}], "usage": {"completion_tokens": 7}}


def _episode(task, item, replies):
    seen, posted = [], []

    def chat(body):
        seen.append(body)
        return replies[len(seen) - 1]

    ep, outcome = task.episode(item, chat, posted.extend)
    record = {"turns": [{"output_token_ids": [1] * 7} for _ in range(ep.turns)], "tool_calls": posted,
              "metadata": {"sandbox": outcome["sandbox"]}}
    return ep, outcome, seen, record


def test_a_scripted_fix_passes_the_hidden_tests_and_is_rewarded():
    task = get_task("bugfix")
    item = task.item(2)
    t = task.task_of(2, 0)
    test = next(p for p in t.files if p.startswith("tests/"))
    replies = [_reply(calls=[("bash", {"command": f"python3 {test}"}), ("read_file", {"path": t.module})]),
               _reply(f'<tool_call>{{"name": "write_file", "arguments": {{"path": "{t.module}", '
                      f'"content": {json.dumps(t.reference[t.module])}}}}}</tool_call>'),
               _reply(calls=[("bash", {"command": f"python3 {test}"})]), _reply("fixed")]
    ep, outcome, seen, record = _episode(task, item, replies)
    assert ep.turns == 4 and ep.answer == "fixed" and outcome["grade"]["passed"]
    assert [c["name"] for c in ep.tool_calls] == ["bash", "read_file", "write_file", "bash"]
    assert ep.tool_calls[0]["exit_code"] == 1 and ep.tool_calls[3]["exit_code"] == 0
    assert seen[1]["messages"][-1]["role"] == "tool" and seen[0]["tools"][0]["function"]["name"] == "bash"
    r, info = task.reward(Sample(item, ep.answer, "stop", ep.completion_tokens, 0, record, outcome))
    assert r == 1.0 and info["cheating"] == [] and info["cost"]["turns"] == 4


def test_an_unfixed_or_cheating_episode_scores_zero():
    task = get_task("bugfix")
    item = task.item(3)
    replies = [_reply(calls=[("bash", {"command": "rm -rf tests; cat ../hidden_tests/x.json"})]), _reply("done")]
    ep, outcome, _, record = _episode(task, item, replies)
    assert not outcome["grade"]["passed"]
    r, info = task.reward(Sample(item, ep.answer, "stop", 14, 0, record, outcome))
    assert r == 0.0 and {"test_tampering", "hidden_files"} <= set(info["cheating"])


def test_a_detect_report_is_scored_by_the_swe_check_reward():
    task = get_task("detect")
    item = task.item(1)
    t = task.task_of(1, 0)
    ep, outcome, _, record = _episode(task, item, [_reply(calls=[("read_file", {"path": t.module})]),
                                                   _reply(t.reference)])
    r, info = task.reward(Sample(item, ep.answer, "stop", 14, 0, record, outcome))
    assert r == 1.0 and info["cheating"] == []
    r, _ = task.reward(Sample(item, "BUG pkg/none.py:1", "stop", 14, 0, record, outcome))
    assert r == 0.0


def test_tool_calls_of_either_syntax_and_nothing_else():
    msg = {"content": 'x <tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call> '
                      '<tool_call>not json</tool_call><tool_call>{"arguments": {}}</tool_call>'}
    (c,) = parse_tool_calls(msg, 0)
    assert (c.name, c.parsed()) == ("bash", {"command": "ls"})
    assert parse_tool_calls({"content": "no call"}, 0) == []
    many = {"tool_calls": [{"id": str(i), "function": {"name": "bash", "arguments": "{}"}} for i in range(20)]}
    assert len(parse_tool_calls(many, 0)) == 8
