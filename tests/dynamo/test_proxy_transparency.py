"""The sandbox proxy is transparent: with the official ``openai`` client, every request is sent to the Dynamo
frontend directly and through ``syncd-proxy`` (same seed, so the same tokens), and the two responses are compared
field by field -- text, log-probs, top log-probs, usage, finish reasons, roles, tool calls -- whole and streamed,
on ``/v1/completions`` and ``/v1/chat/completions``. Only the response id and its creation second may differ."""

from __future__ import annotations

import json
import uuid

import openai  # the official client (the test extra): missing, the test fails rather than skips
import pytest

from syncd.engine.dynamo.serve import Node, NodeConfig
from tests.dynamo.conftest import RUN_ID, start_proxy

pytestmark = [pytest.mark.integration, pytest.mark.slow]

#: what may differ between the two paths: the frontend names each response anew
VOLATILE = {"id", "created"}


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
        direct = openai.OpenAI(base_url=f"{node.frontend_url}/v1", api_key="unused", max_retries=0, timeout=120)
        proxied = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="unused", max_retries=0, timeout=120,
                                default_headers={"X-Syncd-Trajectory": f"oa-{uuid.uuid4().hex[:6]}"})
        yield direct, proxied, cfg.model_name
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
    direct, proxied, model = paths
    a, b = call(direct, model), call(proxied, model)
    return a.model_dump(), b.model_dump()


CASES = {
    "completions, logprobs=2": lambda c, m: c.completions.create(
        model=m, prompt="the cat sat on", max_tokens=6, logprobs=2, seed=11, temperature=0.8),
    "completions, no logprobs": lambda c, m: c.completions.create(
        model=m, prompt="once upon", max_tokens=5, seed=3, temperature=1.0),
    "chat, logprobs and top_logprobs=2": lambda c, m: c.chat.completions.create(
        model=m, messages=[{"role": "user", "content": "hello there"}], max_tokens=6, logprobs=True, top_logprobs=2,
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
        if "top_logprobs=2" in case:
            assert all(entry["top_logprobs"] for entry in lp["content"])


STREAMS = {
    "completions, logprobs=2, usage": lambda c, m: c.completions.create(
        model=m, prompt="the cat sat on", max_tokens=5, logprobs=2, seed=11, stream=True,
        stream_options={"include_usage": True}),
    "chat, top_logprobs=2": lambda c, m: c.chat.completions.create(
        model=m, messages=[{"role": "user", "content": "hello there"}], max_tokens=5, logprobs=True, top_logprobs=2,
        seed=11, stream=True),
    "chat, usage": lambda c, m: c.chat.completions.create(
        model=m, messages=[{"role": "user", "content": "hello"}], max_tokens=4, seed=2, stream=True,
        stream_options={"include_usage": True}),
}


@pytest.mark.parametrize("case", sorted(STREAMS))
def test_streamed_chunks_are_the_frontends(paths, case):
    direct, proxied, model = paths
    a = [chunk.model_dump() for chunk in STREAMS[case](direct, model)]
    b = [chunk.model_dump() for chunk in STREAMS[case](proxied, model)]
    _same(a, b, "chunks")
    assert any(ch["choices"] and ch["choices"][0]["finish_reason"] for ch in a)
    assert ("usage" in case) == (a[-1]["usage"] is not None)  # a usage chunk only when the client asked


def test_raw_json_members_match(paths):
    """Below the client's parsing: the raw JSON of a whole response has the same members with the same values
    (a member the frontend writes as null is null through the proxy too, not missing)."""
    direct, proxied, model = paths
    body = dict(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, seed=9, logprobs=True)
    a = json.loads(direct.chat.completions.with_raw_response.create(**body).text)
    b = json.loads(proxied.chat.completions.with_raw_response.create(**body).text)
    _same(a, b, "raw")
