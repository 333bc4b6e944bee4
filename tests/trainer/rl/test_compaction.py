"""Self-compaction end to end on real parts: a reference-engine worker under the Dynamo frontend with a 128-token
context, the sandbox proxy (``syncd.engine.proxy.Proxy``, in this process, with ``syncd.engine.proxy.compaction``
on) in front of it, a file store for the replay and trajectory records, and the trainer's reader
(``syncd.trainer.rl.rollouts`` + ``syncd.trainer.rl.compaction``). A request for more tokens than the window holds
is compacted into segments; each one is recorded with its exact ids and joins its replay records; every training
sample cut from it is prefix-consistent and equals what the engine saw (a hypothesis property over compaction
settings and requests). Chat requests take the same path (their messages rendered by the model's chat template in
the proxy, every segment sent as token ids), tool-calling episodes of the agent harness too (through a proxy
process), and the ablations (``summary="empty"``, ``"truncate"``) replace the summary as specified."""

from __future__ import annotations

import asyncio
import json
import math
import uuid

import aiohttp
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from syncd.engine.proxy.compaction import CompactionConfig
from syncd.engine.proxy.server import Proxy, ProxyConfig
from syncd.records.trajectory import read_record
from syncd.trainer.rl.compaction import prefix_consistent, training_samples
from syncd.trainer.rl.rollouts import read_rollouts

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RUN = "compaction"
WINDOW = 128


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """``(frontend URL, model name, model folder, store URL)``: one worker whose model has 128 positions."""
    from syncd.engine.reference.make_tiny import write_model
    from tests.dynamo._recording import recording_node

    root = tmp_path_factory.mktemp("compaction")
    model = write_model(root / "tiny", arch="qwen2", seed=3, max_positions=WINDOW)
    with recording_node(root, model, RUN, "c") as (n, cfg, store, _):
        yield n.frontend_url, cfg.model_name, model, store


async def _session(node, compaction, requests, sandbox: str, reward: float = 0.5, endpoint: str = "completions"):
    """Run ``requests`` (``(trajectory, body or body(replies so far))``) in order through a proxy at ``endpoint``,
    finish each trajectory with ``reward``; returns the responses and the trajectory ids."""
    url, model, _, store = node
    proxy = Proxy(ProxyConfig(upstream=url, run_id=RUN, sandbox_id=sandbox, compaction=compaction), store)
    base = await proxy.start()
    replies, tids = [], []
    try:
        async with aiohttp.ClientSession() as http:
            for tid, body in requests:
                body = body(replies) if callable(body) else body
                async with http.post(f"{base}/v1/{endpoint}", json={"model": model, **body},
                                     headers={"X-Syncd-Trajectory": tid}) as resp:
                    replies.append((resp.status, await resp.json(), dict(resp.headers)))
                if tid not in tids:
                    tids.append(tid)
            for tid in tids:
                async with http.post(f"{base}/syncd/trajectories/{tid}/finish",
                                     json={"metadata": {"reward": reward}}) as resp:
                    assert resp.status == 200 and (await resp.json())["written"]
    finally:
        await proxy.close()
    return replies


def _compaction(node, **kw) -> CompactionConfig:
    short = {"summary_prompt": "\nSummarize:", "resume_prompt": "\nNotes:", "continue_prompt": "\nGo on:"}
    return CompactionConfig.for_model(node[2], **{"summary_tokens": 12, "keep_prompt": 8, **short, **kw})


def _rollouts(node, sandbox: str):
    """The sandbox's rollouts, once the engine's replay records (written just after a request ends) are in."""
    import time

    from syncd.trainer.rl.rollouts import MissingReplayError

    deadline = time.monotonic() + 60
    while True:
        try:
            return read_rollouts(node[3], RUN, sandbox_id=sandbox, vocab_size=320)
        except MissingReplayError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


BODY = {"prompt": "a:", "max_tokens": 300, "ignore_eos": True, "temperature": 1.0, "top_p": 0.9, "seed": 5}


def test_a_request_longer_than_the_window_is_compacted_and_every_segment_recorded(node):
    cfg = _compaction(node)
    (status, reply, headers), = asyncio.run(_session(node, cfg, [("t-long", BODY)], "sb-long"))
    assert status == 200, reply
    n = reply["nvext"]["compactions"]
    assert reply["usage"]["completion_tokens"] == 300 and n >= 2  # 300 tokens cannot fit one 96-token budget
    assert int(headers["X-Syncd-Compactions"]) == n
    doc = read_record(node[3], RUN, "sb-long", "t-long")
    assert doc["status"] == "complete"
    roles = [t["compaction"]["role"] for t in doc["turns"]]
    assert roles == ["generate"] + ["summary", "continuation"] * n
    assert [c["summary_turn"] for c in doc["compactions"]] == [1 + 2 * k for k in range(n)]
    assert [c["continuation_turn"] for c in doc["compactions"]] == [2 + 2 * k for k in range(n)]
    assert doc["turns"][0]["compaction"]["client_request"]["prompt"] == "a:"
    turns = doc["turns"]
    for t in turns:
        assert len(t["prompt_token_ids"]) + len(t["output_token_ids"]) <= WINDOW  # never past the window
        assert t["usage"]["prompt_tokens"] == len(t["prompt_token_ids"])  # the engine saw exactly these ids
    for k in range(n):
        seg, summ, cont = turns[2 * k], turns[2 * k + 1], turns[2 * k + 2]
        assert len(seg["prompt_token_ids"]) + len(seg["output_token_ids"]) <= cfg.budget
        assert summ["prompt_token_ids"][:len(seg["prompt_token_ids"]) + len(seg["output_token_ids"])] == \
            seg["prompt_token_ids"] + seg["output_token_ids"]
        s = summ["output_token_ids"]
        p = cont["prompt_token_ids"]
        assert p[:len(turns[0]["prompt_token_ids"][:8])] == turns[0]["prompt_token_ids"][:8]  # the task's head
        assert any(p[i:i + len(s)] == s for i in range(len(p)))  # the summary's sampled ids, verbatim
    visible = [t for t in turns if t["compaction"]["role"] != "summary"]
    assert sum(len(t["output_token_ids"]) for t in visible) == 300
    assert reply["choices"][0]["text"] == "".join(t["text"] for t in visible)


def test_without_compaction_the_window_cuts_the_answer(node):
    (status, reply, _), = asyncio.run(_session(node, None, [("t-cut", BODY)], "sb-cut"))
    assert status == 200
    assert reply["usage"]["completion_tokens"] == WINDOW - reply["usage"]["prompt_tokens"] < 300
    assert reply["choices"][0]["finish_reason"] == "length"


def test_compacted_trajectories_read_back_as_prefix_consistent_samples_with_the_final_reward(node):
    asyncio.run(_session(node, _compaction(node), [("t-read", BODY)], "sb-read", reward=0.75))
    rs = _rollouts(node, "sb-read")
    (ro,) = rs.rollouts
    doc = read_record(node[3], RUN, "sb-read", "t-read")
    n = len(doc["compactions"])
    samples = training_samples(ro)
    assert len(samples) == n + 1  # one per context window
    assert [s.roles for s in samples] == [("generate", "summary")] + [("continuation", "summary")] * (n - 1) \
        + [("continuation",)]
    assert all(prefix_consistent(s, doc) for s in samples)
    assert all(s.reward == 0.75 for s in samples)  # the summaries are credited with the final reward
    summary_ids = [x for t in doc["turns"] if t["compaction"]["role"] == "summary" for x in t["output_token_ids"]]
    trained = [x for s in samples for x in s.sequence.tokens[s.sequence.loss_mask].tolist()]
    assert len(trained) == 300 + len(summary_ids)  # every sampled token is trained once, summaries included
    for s in samples:
        assert len(s.sequence) <= WINDOW and s.sequence.positions.numel() == int(s.sequence.loss_mask.sum())


def test_a_prompt_that_leaves_no_room_is_summarized_first(node):
    body = {**BODY, "prompt": "a:" + "a" * 98, "max_tokens": 20}  # 100 prompt tokens: past the 96-token budget
    (status, reply, _), = asyncio.run(_session(node, _compaction(node), [("t-big", body)], "sb-big"))
    assert status == 200 and reply["usage"] == {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120}
    doc = read_record(node[3], RUN, "sb-big", "t-big")
    assert [t["compaction"]["role"] for t in doc["turns"]] == ["summary", "continuation"]
    assert doc["turns"][0]["compaction"]["client_request"]["prompt"] == body["prompt"]
    assert len(doc["turns"][0]["prompt_token_ids"]) == 100 + 11  # and "\nSummarize:"
    assert all(prefix_consistent(s, doc) for s in training_samples(_rollouts(node, "sb-big").rollouts[0]))


def test_a_later_request_continues_from_the_compacted_context(node):
    first = {**BODY, "max_tokens": 150}

    def second(replies):
        return {**BODY, "prompt": "a:" + replies[0][1]["choices"][0]["text"] + " ok:", "max_tokens": 20}

    replies = asyncio.run(_session(node, _compaction(node), [("t-multi", first), ("t-multi", second)], "sb-multi"))
    assert [r[0] for r in replies] == [200, 200] and replies[0][1]["nvext"]["compactions"] >= 1
    doc = read_record(node[3], RUN, "sb-multi", "t-multi")
    turns = doc["turns"]
    g2 = [t for t in turns if t["compaction"]["role"] == "generate"][-1]  # the later request's first segment
    assert g2["index"] > 0 and g2["compaction"]["request"] == g2["index"]
    before = [t for t in turns[:g2["index"]] if t["compaction"]["role"] != "summary"][-1]
    ctx = before["prompt_token_ids"] + before["output_token_ids"]
    assert g2["prompt_token_ids"][:len(ctx)] == ctx  # extends the live context, not the client's text
    assert len(g2["prompt_token_ids"]) < 2 + 150  # the compacted history is shorter than the client's
    samples = training_samples(_rollouts(node, "sb-multi").rollouts[0])
    assert all(prefix_consistent(s, doc) for s in samples)
    assert any(s.roles[:2] == ("continuation", "generate") for s in samples)  # merged into the live context


@settings(max_examples=5, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(trigger=st.sampled_from([0.6, 0.75, 0.85]), summary_tokens=st.integers(1, 12),
       keep=st.integers(0, 6), max_tokens=st.integers(110, 260), letter=st.sampled_from("abcd"),
       temperature=st.sampled_from([0.7, 1.0]), seed=st.integers(0, 1000))
def test_every_sample_is_prefix_consistent_and_equals_what_the_engine_saw(node, trigger, summary_tokens, keep,
                                                                        max_tokens, letter, temperature, seed):
    assume(math.floor(trigger * WINDOW) + len("\nSummary:") + summary_tokens <= WINDOW)  # else refused at start-up
    sandbox = f"sb-p{uuid.uuid4().hex[:8]}"
    cfg = _compaction(node, trigger=trigger, summary_tokens=summary_tokens, keep_prompt=keep,
                      summary_prompt="\nSummary:")
    body = {"prompt": f"{letter}:", "max_tokens": max_tokens, "ignore_eos": True, "temperature": temperature,
            "top_k": 20, "seed": seed}
    (status, reply, _), = asyncio.run(_session(node, cfg, [("t", body)], sandbox))
    assert status == 200 and reply["usage"]["completion_tokens"] == max_tokens, reply
    doc = read_record(node[3], RUN, sandbox, "t")
    (ro,) = _rollouts(node, sandbox).rollouts  # joined with the engine's replay records: ids, versions, log-probs
    samples = training_samples(ro)
    assert doc["compactions"] and len(samples) == len(doc["compactions"]) + 1  # one per context window
    for s in samples:
        assert prefix_consistent(s, doc)
        assert len(s.sequence) <= WINDOW


def test_the_loops_rollout_workers_take_compacted_groups_from_a_curated_task(node):
    """The loop's side: rollout workers (HTTP, threads) through a compacting proxy, on a curated task: the group
    reaches the buffer with one sequence per context window, one advantage per sequence, and the curator saw its
    rewards."""
    import threading

    from syncd.trainer.rl.buffer import RolloutBuffer, group_advantages
    from syncd.trainer.rl.compaction import sequence_rewards
    from syncd.trainer.rl.curation import CuratedTask, CurationConfig
    from syncd.trainer.rl.rollout_workers import RolloutWorkers, Sampling
    from syncd.trainer.rl.tasks import get_task

    url, model, _, store = node
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    proxy = Proxy(ProxyConfig(upstream=url, run_id=RUN, sandbox_id="sb-loop", compaction=_compaction(node)), store)
    base = asyncio.run_coroutine_threadsafe(proxy.start(), loop).result(60)
    task = CuratedTask(get_task("repeat", length=150), CurationConfig(pool=2))
    buf = RolloutBuffer(1)
    workers = RolloutWorkers(proxies=[base], model_name=model, task=task, reward=task.reward,
                             group_size=2, sampling=Sampling(1.0, 1.0, 20), store=store, run_id=RUN, buffer=buf,
                             version=lambda: 0, step=lambda: 1, workers=1, vocab_size=320).start()
    try:
        workers.allow(1)
        (group,) = buf.take(1, 0, timeout_s=300)
    finally:
        workers.stop(10)
        asyncio.run_coroutine_threadsafe(proxy.close(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
    assert workers.stats()["failures"] == {k: 0 for k in workers.failures.totals}
    seqs = [s for ro in group.rollouts for s in ro.sequences]
    assert all(len(ro.sequences) >= 2 and ro.compaction for ro in group.rollouts)  # 150 tokens > one window
    assert group.tokens == sum(int(s.loss_mask.sum()) for s in seqs) > 2 * 150  # summaries are trained too
    adv = sequence_rewards(group.rollouts, group_advantages(group.rewards))
    assert adv.numel() == len(seqs)
    assert task.draws == 1 and task.curator.estimate(0).attempts == 2  # the curator saw both rewards


def test_per_request_trajectories_are_written_when_a_compacted_request_ends(node):
    from syncd.records.trajectory import list_records

    url, model, _, store = node

    async def go():
        proxy = Proxy(ProxyConfig(upstream=url, run_id=RUN, sandbox_id="sb-per", per_request=True,
                                  compaction=_compaction(node)), store)
        base = await proxy.start()
        try:
            async with aiohttp.ClientSession() as http:
                async with http.post(f"{base}/v1/completions", json={"model": model, **BODY}) as resp:
                    assert resp.status == 200
            for _ in range(200):  # written in the background once the request ended, before the proxy stops
                if proxy.written:
                    return dict(proxy.written), dict(proxy.compactor._live)
                await asyncio.sleep(0.05)
            raise AssertionError("the per-request trajectory was not written")
        finally:
            await proxy.close()

    written, live = asyncio.run(go())
    ((tid, _),) = written.items()
    assert live == {}  # a finished trajectory's live context is dropped
    assert list_records(store, RUN, "sb-per") == [("sb-per", tid)]
    assert len(read_record(store, RUN, "sb-per", tid)["compactions"]) >= 2


def _stream_events(node, sandbox: str, path: str, body: dict, headers=None) -> list[str]:
    """POST ``body`` (streamed) through a compacting proxy of ``sandbox`` to ``path``; the SSE data lines."""
    url, model, _, store = node

    async def go():
        proxy = Proxy(ProxyConfig(upstream=url, run_id=RUN, sandbox_id=sandbox, compaction=_compaction(node)), store)
        base = await proxy.start()
        try:
            async with aiohttp.ClientSession() as http:
                async with http.post(f"{base}/v1/{path}", json={"model": model, **body}, headers=headers) as r:
                    assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
                    return (await r.read()).decode()
        finally:
            await proxy.close()

    return [e[len("data: "):] for e in asyncio.run(go()).split("\n\n") if e.startswith("data: ")]


def test_a_streaming_client_gets_the_compacted_answer_as_one_chunk(node):
    store = node[3]
    events = _stream_events(node, "sb-stream", "completions", {**BODY, "stream": True,
                                                                "stream_options": {"include_usage": True}},
                            headers={"X-Syncd-Trajectory": "s"})
    assert events[-1] == "[DONE]" and len(events) == 2
    chunk = json.loads(events[0])
    assert chunk["usage"]["completion_tokens"] == 300 and chunk["choices"][0]["finish_reason"] == "length"
    doc = read_record(store, RUN, "sb-stream", "s")
    visible = [t for t in doc["turns"] if t["compaction"]["role"] != "summary"]
    assert chunk["choices"][0]["text"] == "".join(t["text"] for t in visible) and chunk["nvext"]["compactions"] >= 2


# ------------------------------------------------------------------------------------ chat

CHAT = {"messages": [{"role": "system", "content": "Write letters."}, {"role": "user", "content": "a:" + "a" * 20}],
        "max_tokens": 200, "ignore_eos": True, "temperature": 1.0, "top_p": 0.9, "seed": 7}


def _chat_prompt_ids(node, messages) -> list[int]:
    from syncd.engine.proxy.compaction import Compactor

    c = Compactor(_compaction(node))
    return c.encode(c.chat.render({"messages": messages}))


def test_a_chat_request_is_compacted_end_to_end_and_reads_back_prefix_consistent(node):
    (status, reply, headers), = asyncio.run(_session(node, _compaction(node), [("t-chat", CHAT)], "sb-chat",
                                                    endpoint="chat/completions"))
    assert status == 200, reply
    n = reply["nvext"]["compactions"]
    assert reply["object"] == "chat.completion" and reply["usage"]["completion_tokens"] == 200 and n >= 2
    assert int(headers["X-Syncd-Compactions"]) == n
    doc = read_record(node[3], RUN, "sb-chat", "t-chat")
    turns = doc["turns"]
    assert doc["status"] == "complete" and [t["compaction"]["role"] for t in turns] == \
        ["generate"] + ["summary", "continuation"] * n
    prompt = _chat_prompt_ids(node, CHAT["messages"])  # the chat template's text, tokenised by the proxy
    assert turns[0]["prompt_token_ids"] == prompt and turns[0]["compaction"]["client_request"]["messages"]
    for t in turns:  # every segment went upstream as completions with token ids, never as messages
        assert t["endpoint"] == "completions" and t["request"]["prompt"] == t["prompt_token_ids"]
        assert "messages" not in t["request"] and len(t["prompt_token_ids"]) + len(t["output_token_ids"]) <= WINDOW
    assert turns[2]["prompt_token_ids"][:8] == prompt[:8]  # the head of the rendered chat
    visible = [t for t in turns if t["compaction"]["role"] != "summary"]
    assert reply["choices"][0]["message"] == {"role": "assistant", "content": "".join(t["text"] for t in visible),
                                              "refusal": None}
    samples = training_samples(_rollouts(node, "sb-chat").rollouts[0])
    assert len(samples) == n + 1 and all(prefix_consistent(s, doc) for s in samples)


def test_a_later_chat_request_continues_from_the_compacted_context(node):
    def second(replies):
        answer = replies[0][1]["choices"][0]["message"]["content"]
        return {**CHAT, "max_tokens": 10, "messages": CHAT["messages"] + [
            {"role": "assistant", "content": answer}, {"role": "user", "content": "b:"}]}

    replies = asyncio.run(_session(node, _compaction(node), [("t-chat2", {**CHAT, "max_tokens": 120}),
                                                             ("t-chat2", second)], "sb-chat2",
                                   endpoint="chat/completions"))
    assert [r[0] for r in replies] == [200, 200] and replies[0][1]["nvext"]["compactions"] >= 1
    turns = read_record(node[3], RUN, "sb-chat2", "t-chat2")["turns"]
    g2 = [t for t in turns if t["compaction"]["role"] == "generate"][-1]
    before = [t for t in turns[:g2["index"]] if t["compaction"]["role"] != "summary"][-1]
    ctx = before["prompt_token_ids"] + before["output_token_ids"]
    assert g2["index"] > 0 and g2["prompt_token_ids"][:len(ctx)] == ctx  # the live context, extended
    assert all(prefix_consistent(s, read_record(node[3], RUN, "sb-chat2", "t-chat2"))
               for s in training_samples(_rollouts(node, "sb-chat2").rollouts[0]))


def test_a_streaming_chat_client_gets_one_chunk(node):
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    events = _stream_events(node, "sb-chats", "chat/completions", body)
    assert events[-1] == "[DONE]" and len(events) == 2
    chunk = json.loads(events[0])
    assert chunk["object"] == "chat.completion.chunk" and chunk["usage"]["completion_tokens"] == 200
    assert chunk["choices"][0]["delta"]["role"] == "assistant" and len(chunk["choices"][0]["delta"]["content"]) > 0


@pytest.mark.parametrize("mode", ["empty", "truncate"])
def test_the_ablations_replace_the_summary_with_nothing_or_the_recent_tokens(node, mode):
    cfg = _compaction(node, summary=mode)
    sandbox = f"sb-{mode}"
    (status, reply, _), = asyncio.run(_session(node, cfg, [("t", CHAT)], sandbox, endpoint="chat/completions"))
    assert status == 200 and reply["usage"]["completion_tokens"] == 200 and reply["nvext"]["compactions"] >= 2
    doc = read_record(node[3], RUN, sandbox, "t")
    turns = doc["turns"]
    assert {t["compaction"]["role"] for t in turns[1:]} == {"continuation"} and doc["compactions"] == []
    from syncd.engine.proxy.compaction import Compactor

    c = Compactor(cfg)
    head = turns[0]["prompt_token_ids"][:8]
    for prev, cont in zip(turns, turns[1:]):
        if mode == "empty":
            assert cont["prompt_token_ids"] == head + c.resume_ids + c.continue_ids
        else:
            keep = len(c.resume_ids) + cfg.summary_tokens + len(c.continue_ids)
            assert cont["prompt_token_ids"] == head + (prev["prompt_token_ids"] + prev["output_token_ids"])[-keep:]
    assert all(prefix_consistent(s, doc) for s in training_samples(_rollouts(node, sandbox).rollouts[0]))


class _ToolEnv:
    """The task's side of a tool-calling episode (``syncd.trainer.agent.episode.Environment``), scripted: a
    ``lookup`` call on every turn whatever the random model wrote, whose output the next turn's prompt carries."""

    OUTPUT = "b" * 40  # the live context, this and the summary's room pass the 128-token window

    def messages(self):
        return [{"role": "system", "content": "Use the tool."}, {"role": "user", "content": "a:" + "a" * 20}]

    def tools(self):
        from syncd.trainer.agent.envs import LOOKUP_TOOLS

        return LOOKUP_TOOLS

    def calls(self, turn, message):
        from syncd.trainer.agent.episode import Call

        return [Call(f"call-{turn}", "lookup", json.dumps({"query": "q"}))]

    def run(self, call):
        from syncd.trainer.agent.episode import ToolRun

        return ToolRun(self.OUTPUT, output_bytes=len(self.OUTPUT))


def test_a_tool_calling_episode_is_compacted_turn_after_turn_and_trains_prefix_consistent(node, tmp_path):
    """The agent harness's loop (``run_episode``: chat with ``tools``, tool calls posted, tool outputs appended)
    through a compacting proxy process: every turn is compacted (its messages and tools rendered by the chat
    template), a later turn continues from the live context with the tool's output appended, the record holds
    every turn and tool call, and the trainer's samples are prefix-consistent."""
    from syncd import http_client
    from syncd.engine.proxy.compaction import Compactor
    from syncd.engine.proxy.procs import start_proxy
    from syncd.procs import stop_process
    from syncd.trainer.agent.episode import run_episode

    url, model, folder, store = node
    sandbox, tid = "sb-tools", "t-tools"
    proc, base = start_proxy(tmp_path, url, store, RUN, sandbox, "--compact-model", str(folder),
                             "--compact-trigger", "0.5", "--compact-summary-tokens", "12", "--compact-keep-prompt", "8",
                             "--compact-summary-prompt", "\nSummarize:", "--compact-resume-prompt", "\nNotes:",
                             "--compact-continue-prompt", "\nGo on:")
    headers = {"X-Syncd-Trajectory": tid}
    try:
        def chat(body):
            status, reply = http_client.request_json(
                "POST", base, "/v1/chat/completions", {"model": model, **body, "max_tokens": 80, "ignore_eos": True,
                                                        "temperature": 1.0, "seed": 11}, headers=headers, timeout_s=120)
            assert status == 200, reply
            return reply

        def post(calls):
            status, reply = http_client.request_json("POST", base, f"/syncd/trajectories/{tid}/tool_calls",
                                                     {"tool_calls": calls}, timeout_s=30)
            assert status == 200, reply

        ep = run_episode(chat, _ToolEnv(), max_turns=3, post_calls=post)
        status, reply = http_client.request_json("POST", base, f"/syncd/trajectories/{tid}/finish",
                                                 {"metadata": {"reward": 1.0}}, timeout_s=30)
        assert status == 200 and reply["written"], reply
    finally:
        stop_process(proc, 10)
    assert ep.turns == 3 and [c["name"] for c in ep.tool_calls] == ["lookup", "lookup"]
    doc = read_record(store, RUN, sandbox, tid)
    assert doc["status"] == "complete"
    assert [(c["id"], c["output"]) for c in doc["tool_calls"]] == [("call-0", _ToolEnv.OUTPUT),
                                                                   ("call-1", _ToolEnv.OUTPUT)]
    turns = doc["turns"]
    firsts = [t for t in turns if "client_request" in t["compaction"]]  # each client request's first segment
    assert len(firsts) == 3 and all(t["compaction"]["client_request"]["tools"] == _ToolEnv().tools() for t in firsts)
    assert all(t["endpoint"] == "completions" and "tools" not in t["request"] for t in turns)
    summarize = Compactor(_compaction(node)).encode("\nSummarize:")
    out = Compactor(_compaction(node)).encode(_ToolEnv.OUTPUT)
    for k in (1, 2):  # each later request: the live context summarized first (with the tool's output after it,
        n = firsts[k]["index"]  # there would be no room to summarize), then the output appended and compacted
        before = [t for t in turns[:n] if t["compaction"]["role"] != "summary"][-1]
        ctx = before["prompt_token_ids"] + before["output_token_ids"]
        assert turns[n]["compaction"]["role"] == "summary" and turns[n]["prompt_token_ids"] == ctx + summarize
        assert _holds(turns[n + 1]["prompt_token_ids"], out)  # the continuation, with the tool's output
    assert doc["compactions"] and all(len(t["prompt_token_ids"]) + len(t["output_token_ids"]) <= WINDOW
                                      for t in turns)
    samples = training_samples(_rollouts(node, sandbox).rollouts[0])
    assert samples and all(prefix_consistent(s, doc) for s in samples)
    trained = sum(int(s.sequence.loss_mask.sum()) for s in samples)
    assert trained == sum(len(t["output_token_ids"]) for t in turns)  # every sampled token, once, summaries too
    visible = [t for t in turns if t["compaction"]["role"] != "summary"]
    assert ep.completion_tokens == sum(len(t["output_token_ids"]) for t in visible)


def _holds(ids: list[int], part: list[int]) -> bool:
    return any(ids[i:i + len(part)] == part for i in range(len(ids) - len(part) + 1))
