"""``syncd.engine.proxy.compaction`` without an engine: the policy (when a request is compacted, the room it leaves), the
configuration checks, and the record members that mark the segments (the end-to-end path through a real engine is
tests/trainer/rl/test_compaction.py)."""

from __future__ import annotations

import json

import pytest

from syncd.engine.proxy.compaction import CompactionConfig, Compactor, _Live
from syncd.engine.proxy.record import RecordError, Trajectory, Turn
from syncd.records.trajectory import parse


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from syncd.engine.reference.make_tiny import write_model

    return write_model(tmp_path_factory.mktemp("cmodel") / "tiny", arch="qwen2", seed=1, hidden=16, layers=1,
                       heads=2, kv_heads=1, intermediate=32, max_positions=128)


def _compactor(model, **kw) -> Compactor:
    short = dict(summary_prompt="\nSummarize:", resume_prompt="\nNotes:", continue_prompt="\nGo on:",
                 summary_tokens=12, keep_prompt=8)
    return Compactor(CompactionConfig.for_model(model, **{**short, **kw}))


def test_the_window_and_tokenizer_come_from_the_model(model):
    c = _compactor(model)
    assert c.config.window == 128 and c.config.budget == 96
    assert c.encode("a:") == [64, 25]  # the byte-level tokenizer the frontend uses


def test_only_requests_that_would_pass_the_trigger_are_compacted(model):
    c = _compactor(model)
    assert c.plan("t", {"prompt": "a:", "max_tokens": 94}, "completions") is None  # 2 + 94 = 96: fits
    req = c.plan("t", {"prompt": "a:", "max_tokens": 95}, "completions")
    assert req.context == [64, 25] and req.head == [64, 25] and req.max_tokens == 95
    assert c.plan("t", {"prompt": [64] * 90, "max_tokens": 10}, "completions").context == [64] * 90
    assert c.plan("t", {"prompt": [64] * 90, "max_tokens": 10}, "completions").head == [64] * 8
    assert c.plan("t", {"prompt": [64] * 100, "max_tokens": 4}, "completions").context == [64] * 100  # summarized
    assert c.plan("t", {"prompt": [64] * 110, "max_tokens": 4}, "completions") is None  # too long to summarize
    for body, endpoint in [({"messages": [], "max_tokens": 500}, "chat/completions"),
                           ({"prompt": "a:", "max_tokens": 500, "n": 2}, "completions"),
                           ({"prompt": ["a:", "b:"], "max_tokens": 500}, "completions"),
                           ({"prompt": "a:", "max_tokens": "many"}, "completions")]:
        assert c.plan("t", body, endpoint) is None  # passes through; the frontend answers what is wrong


def test_a_later_request_of_a_compacted_trajectory_extends_its_live_context(model):
    c = _compactor(model)
    c._live["t"] = _Live("a:xyz", [1, 2, 3], [1])
    req = c.plan("t", {"prompt": "a:xyz ok:", "max_tokens": 4}, "completions")
    assert req.context == [1, 2, 3] and req.tail == c.encode(" ok:") and req.head == [1]  # even when it fits
    assert c.plan("t", {"prompt": "b:", "max_tokens": 4}, "completions") is None  # another history: a fresh one
    assert c.plan("u", {"prompt": "a:xyz ok:", "max_tokens": 4}, "completions") is None


@pytest.mark.parametrize("kw, what", [
    (dict(trigger=0.95), "no room for the summary"),
    (dict(keep_prompt=80), "leaves no room to generate"),
    (dict(summary_prompt="x" * 40), "no room for the summary"),
])
def test_configurations_that_leave_no_room_are_refused(model, kw, what):
    with pytest.raises(ValueError, match=what):
        _compactor(model, **kw)


@pytest.mark.parametrize("kw", [dict(trigger=0), dict(trigger=1.5), dict(summary_tokens=0), dict(window=4)])
def test_bad_settings_are_refused(kw):
    with pytest.raises(ValueError, match="compaction"):
        CompactionConfig(**{"window": 128, "tokenizer": "x", **kw})


def _compacted() -> Trajectory:
    t = Trajectory("run", "sb", "t")
    ok = dict(status="ok", versions=[0], logprobs=[-1.0], segments=[{"request_id": "r", "start": 0, "count": 1}],
              output_token_ids=[5])
    for i, role in enumerate(["generate", "summary", "continuation", "summary"]):
        t.turns.append(Turn(i, "completions", {}, False, prompt_token_ids=[1] * (i + 1),
                            compaction={"request": 0, "segment": i, "role": role}, **ok))
    return t


def test_the_record_marks_the_segment_boundaries():
    doc = parse(_compacted().encode())
    assert doc["compactions"] == [{"request": 0, "summary_turn": 1, "context_tokens": 2, "continuation_turn": 2},
                                  {"request": 0, "summary_turn": 3, "context_tokens": 4, "continuation_turn": None}]
    assert [t["compaction"]["role"] for t in doc["turns"]] == ["generate", "summary", "continuation", "summary"]
    plain = Trajectory("run", "sb", "p")
    plain.turns.append(Turn(0, "completions", {}, False, status="ok"))
    assert "compactions" not in plain.to_json() and "compaction" not in plain.to_json()["turns"][0]  # unchanged


@pytest.mark.parametrize("fn", [lambda d: d["turns"][1].update(compaction={"role": "nap", "request": 0, "segment": 1}),
                                lambda d: d["turns"][1].update(compaction="summary"),
                                lambda d: d["compactions"].append({"summary_turn": 2}),
                                lambda d: d.update(compactions={"summary_turn": 1})])
def test_malformed_compaction_members_are_refused(fn):
    doc = json.loads(_compacted().encode())
    fn(doc)
    with pytest.raises(RecordError, match="compaction"):
        parse(json.dumps(doc).encode())


def test_a_chat_request_is_planned_from_its_rendered_messages(model):
    c = _compactor(model)
    messages = [{"role": "user", "content": "a:" + "a" * 40}]
    text = "<|im_start|>user\na:" + "a" * 40 + "<|im_end|>\n<|im_start|>assistant\n"  # make_tiny's ChatML
    req = c.plan("t", {"messages": messages, "max_tokens": 60}, "chat/completions")
    assert req.endpoint == "chat/completions" and req.prompt_text == text and req.context == c.encode(text)
    assert req.context[0] == 257 and req.head == req.context[:8]  # <|im_start|> is one special token
    assert c.plan("t", {"messages": messages, "max_completion_tokens": 60, "max_tokens": 1},
                  "chat/completions").max_tokens == 60
    for body in [{"messages": messages, "max_tokens": 10},                       # fits
                 {"messages": messages},                                         # no bound to compact against
                 {"messages": "hi", "max_tokens": 60}, {"messages": [1], "max_tokens": 60}]:  # the frontend answers
        assert c.plan("t", body, "chat/completions") is None


def test_a_chat_with_tools_is_compacted_unless_its_output_is_constrained(model):
    c = _compactor(model)
    body = {"messages": [{"role": "user", "content": "a:" + "a" * 40}], "max_tokens": 60, "tools": [_TOOL]}
    assert c.plan("t", body, "chat/completions") is not None
    for extra in [{"tool_choice": "auto"}, {"tool_choice": "none"}, {"response_format": {"type": "text"}}]:
        assert c.plan("t", {**body, **extra}, "chat/completions") is not None
    for extra in [{"tool_choice": "required"}, {"tool_choice": {"type": "function", "function": {"name": "f"}}},
                  {"response_format": {"type": "json_object"}}]:  # a segment sent as a completion would lose it
        assert c.plan("t", {**body, **extra}, "chat/completions") is None


_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


def test_a_folder_without_a_chat_template_passes_chat_through(model, tmp_path):
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(model, folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    c = _compactor(folder)
    assert c.chat is None
    assert c.plan("t", {"messages": [{"role": "user", "content": "a" * 90}], "max_tokens": 60},
                  "chat/completions") is None
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert _compactor(folder).plan("t", {"messages": [{"role": "user", "content": "a" * 90}], "max_tokens": 60},
                                   "chat/completions").prompt_text == "a" * 90  # the .jinja file wins
    (folder / "chat_template.jinja").write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match="does not compile"):
        _compactor(folder)


def test_the_summary_modes_are_checked():
    assert CompactionConfig(window=128, tokenizer="x", summary="truncate").summary == "truncate"
    with pytest.raises(ValueError, match="compaction summary must be one of model, empty, truncate"):
        CompactionConfig(window=128, tokenizer="x", summary="none")


def test_a_special_token_the_model_stopped_on_is_not_given_twice(model):
    c = _compactor(model)
    assert c._unseen([258]) == "<|im_end|>" and c._unseen([64]) == "" and c._unseen([]) == ""
    c._live["t"] = _Live("<|im_start|>assistant\nab", [1, 2, 258], [1], "<|im_end|>")  # stopped on <|im_end|>
    req = c.plan("t", {"messages": [{"role": "assistant", "content": "ab"}, {"role": "user", "content": "c"}],
                       "max_tokens": 4}, "chat/completions")
    assert req.context == [1, 2, 258]
    assert req.tail == c.encode("\n<|im_start|>user\nc<|im_end|>\n<|im_start|>assistant\n")
