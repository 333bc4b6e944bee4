"""The sandbox proxy is transparent: with the official ``openai`` client, every request is sent to the Dynamo
frontend directly and through ``syncd-proxy`` (same seed, so the same tokens), and the two responses are compared
field by field -- text, log-probs, top log-probs, usage, finish reasons, roles, tool calls -- whole and streamed,
on ``/v1/completions`` and ``/v1/chat/completions``, and on the routes the proxy passes on, ``/v1/responses`` and
``/v1/models/<id>``. Only the ids and creation times may differ. A request the frontend or a worker refuses gets
the same error both ways, with the reason (which option, which model), at once: the proxy does not retry it."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

import openai  # the official client (the test extra): missing, the test fails rather than skips
import pytest

from syncd.engine.dynamo.node import Node, NodeConfig
from syncd.records.trajectory import read_record
from tests.dynamo._client import get_json, post_json
from tests.dynamo.conftest import RUN_ID, start_proxy

pytestmark = [pytest.mark.integration, pytest.mark.slow]

#: what may differ between the two paths: the frontend names each response (and a response's items) anew
VOLATILE = {"id", "created", "created_at", "item_id"}


@dataclass
class Paths:
    direct: openai.OpenAI
    proxied: openai.OpenAI
    model: str
    proxy_url: str
    store_url: str
    trajectory: str  # of the proxied client's requests


@pytest.fixture(scope="module")
def paths(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("transparent")
    store_url = (root / "store").resolve().as_uri()
    (root / "store").mkdir()
    cfg = NodeConfig.recording(model_dir, root, store_url=store_url, run_id=RUN_ID, prefix="t")
    node = Node(cfg).start()
    proxy = None
    try:
        proxy = start_proxy(root, node.frontend_url, store_url, "sb-openai")
        tid = f"oa-{uuid.uuid4().hex[:6]}"
        direct = openai.OpenAI(base_url=f"{node.frontend_url}/v1", api_key="unused", max_retries=0, timeout=120)
        proxied = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="unused", max_retries=0, timeout=120,
                                default_headers={"X-Syncd-Trajectory": tid})
        yield Paths(direct, proxied, cfg.model_name, proxy.url, store_url, tid)
    finally:
        if proxy is not None:
            proxy.stop()
        node.close()


def _same(a, b, where="response"):
    """Assert ``a == b`` member by member (naming the first member that differs), but for :data:`VOLATILE`."""
    if isinstance(a, dict) and isinstance(b, dict):
        assert set(a) - VOLATILE == set(b) - VOLATILE, f"{where}: members {sorted(set(a) ^ set(b))} differ"
        for k in a:
            if k not in VOLATILE:
                _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), f"{where}: {len(a)} items directly, {len(b)} through the proxy"
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} directly, {b!r} through the proxy"


def _both(paths, call):
    direct, proxied, model = paths.direct, paths.proxied, paths.model
    a, b = call(direct, model), call(proxied, model)
    return a.model_dump(), b.model_dump()


CASES = {
    "completions, logprobs=1": lambda c, m: c.completions.create(
        model=m, prompt="the cat sat on", max_tokens=6, logprobs=1, seed=11, temperature=0.8),
    "completions, no logprobs": lambda c, m: c.completions.create(
        model=m, prompt="once upon", max_tokens=5, seed=3, temperature=1.0),
    "chat, logprobs and top_logprobs=1": lambda c, m: c.chat.completions.create(
        model=m, messages=[{"role": "user", "content": "hello there"}], max_tokens=6, logprobs=True, top_logprobs=1,
        seed=11, temperature=0.8),
    "chat, stop on a token": lambda c, m: c.chat.completions.create(
        model=m, messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        max_tokens=8, seed=5, temperature=1.0, stop=["a"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_whole_responses_are_the_frontends(paths, case):
    a, b = _both(paths, CASES[case])
    _same(a, b)
    assert a["choices"][0]["finish_reason"] in ("length", "stop") and a["usage"]["completion_tokens"] > 0
    if "logprobs" in case and "no logprobs" not in case:
        lp = b["choices"][0]["logprobs"]  # what the issue saw as null through the proxy
        assert lp is not None
        n = a["usage"]["completion_tokens"]
        assert len(lp["content"] if "content" in lp else lp["token_logprobs"]) == n
        if "top_logprobs=1" in case:
            assert all(len(entry["top_logprobs"]) == 1 for entry in lp["content"])


STREAMS = {
    "completions, logprobs=1, usage": lambda c, m: c.completions.create(
        model=m, prompt="the cat sat on", max_tokens=5, logprobs=1, seed=11, stream=True,
        stream_options={"include_usage": True}),
    "chat, top_logprobs=1": lambda c, m: c.chat.completions.create(
        model=m, messages=[{"role": "user", "content": "hello there"}], max_tokens=5, logprobs=True, top_logprobs=1,
        seed=11, stream=True),
    "chat, usage": lambda c, m: c.chat.completions.create(
        model=m, messages=[{"role": "user", "content": "hello"}], max_tokens=4, seed=2, stream=True,
        stream_options={"include_usage": True}),
}


@pytest.mark.parametrize("case", sorted(STREAMS))
def test_streamed_chunks_are_the_frontends(paths, case):
    direct, proxied, model = paths.direct, paths.proxied, paths.model
    a = [chunk.model_dump() for chunk in STREAMS[case](direct, model)]
    b = [chunk.model_dump() for chunk in STREAMS[case](proxied, model)]
    _same(a, b, "chunks")
    assert any(ch["choices"] and ch["choices"][0]["finish_reason"] for ch in a)
    assert ("usage" in case) == (a[-1]["usage"] is not None)  # a usage chunk only when the client asked


def test_raw_json_members_match(paths):
    """Below the client's parsing: the raw JSON of a whole response has the same members with the same values
    (a member the frontend writes as null is null through the proxy too, not missing)."""
    direct, proxied, model = paths.direct, paths.proxied, paths.model
    body = dict(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, seed=9, logprobs=True)
    a = json.loads(direct.chat.completions.with_raw_response.create(**body).text)
    b = json.loads(proxied.chat.completions.with_raw_response.create(**body).text)
    _same(a, b, "raw")


CHAT = [{"role": "user", "content": "hi"}]
REFUSALS = {  # what the client sends -> what the reason names
    "a model the frontend does not serve": (dict(model="no-such-model"), 404, "Model not found"),
    "n=2": (dict(n=2), 400, "does not support n=2"),
    "presence_penalty": (dict(presence_penalty=0.5), 400, "does not support presence_penalty=0.5"),
    "response_format": (dict(response_format={"type": "json_object"}), 400, "(asked for by response_format"),
    "top_logprobs=3": (dict(logprobs=True, top_logprobs=3), 400, "does not support top_logprobs=3"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_refused_request_gets_the_frontends_error_with_the_reason_at_once(paths, case, stream):
    """Before: the frontend said only "Invalid request", and the proxy retried it five times and answered 502."""
    over, status, reason = REFUSALS[case]
    errors = []
    for client in (paths.direct, paths.proxied):
        with pytest.raises(openai.APIError) as info:
            reply = client.chat.completions.create(**{"model": paths.model, "messages": CHAT, "max_tokens": 4,
                                                      "stream": stream, **over})
            for _ in reply:  # a worker's refusal comes as the stream's first event
                pass
        errors.append(info.value)
    direct, proxied = errors
    assert type(direct) is type(proxied) and reason in str(direct) and reason in str(proxied), (direct, proxied)
    assert getattr(direct, "status_code", None) == getattr(proxied, "status_code", None)
    if not stream or status == 404:
        assert proxied.status_code == status
    status, doc = get_json(f"{paths.proxy_url}/syncd/trajectories/{paths.trajectory}")
    turn = doc["turns"][-1]
    assert turn["status"] == "failed" and reason in turn["error"] and len(turn["attempts"]) == 1, turn


def test_a_model_lookup_is_the_frontends(paths):
    direct, proxied, model = paths.direct, paths.proxied, paths.model
    _same(direct.models.retrieve(model).model_dump(), proxied.models.retrieve(model).model_dump())
    for client in (direct, proxied):
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("no-such-model")


def test_a_responses_call_is_the_frontends_and_recorded(paths):
    direct, proxied, model = paths.direct, paths.proxied, paths.model
    tid = f"resp-{uuid.uuid4().hex[:6]}"
    proxied = proxied.with_options(default_headers={"X-Syncd-Trajectory": tid})
    body = dict(model=model, input="hello there", max_output_tokens=6, temperature=0)
    a, b = direct.responses.create(**body).model_dump(), proxied.responses.create(**body).model_dump()
    _same(a, b)
    assert b["usage"]["output_tokens"] > 0
    events_a = [e.model_dump() for e in direct.responses.create(**body, stream=True)]
    events_b = [e.model_dump() for e in proxied.responses.create(**body, stream=True)]
    _same(events_a, events_b, "events")
    assert events_b[-1]["type"] in ("response.completed", "response.incomplete")

    status, _, done = post_json(f"{paths.proxy_url}/syncd/trajectories/{tid}/finish", {})
    assert status == 200 and done["written"], done
    rec = read_record(paths.store_url, RUN_ID, "sb-openai", tid)
    assert rec["status"] == "failed" and "no token record" in rec["failure"]  # the frontend sends none here
    text = "".join(p["text"] for item in b["output"] for p in item["content"] if p["type"] == "output_text")
    for turn, stream in zip(rec["turns"], (False, True)):
        assert (turn["endpoint"], turn["stream"], turn["status"]) == ("responses", stream, "failed")
        assert turn["text"] == text and turn["usage"]["output_tokens"] == b["usage"]["output_tokens"]
        assert turn["finish_reason"] in ("stop", "length") and turn["request"]["input"] == "hello there"
