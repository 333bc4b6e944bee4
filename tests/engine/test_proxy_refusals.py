"""What the proxy retries and what it passes on at once, and the routes it passes through: an in-process
``syncd.engine.proxy.server.Proxy`` in front of a *mock* Dynamo frontend (a small aiohttp server on loopback that
answers with the shapes the real frontend 1.6 sends, recorded from it; ``tests/dynamo`` checks the same against
the real one).

* the client's mistakes -- a model the frontend does not list (404), a value it refuses (400), an option a worker
  refuses (an error event with code 400 on a stream that said 200) -- are passed on at once with the frontend's
  reason, in the shape the frontend gives a whole or a streamed request, after one upstream attempt; the turn is
  recorded as failed with the reason;
* upstream failures are retried: HTTP 5xx, an error event without a client-error code, and a 404 while the
  frontend lists no model at all (discovery still catching up);
* ``GET /v1/models/<id>`` and ``POST /v1/responses`` go through, and a Responses call is recorded as a turn."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from syncd.engine.proxy.server import Proxy, ProxyConfig
from syncd.records.trajectory import parse

MODEL = "tiny"
NOT_FOUND = {"message": "Model not found", "type": "Not Found", "code": 404}
REFUSED = {"error": {"message": "this engine does not support n=2", "type": "invalid_request_error", "code": 400}}
RESPONSE = {"id": "resp_1", "object": "response", "model": MODEL, "status": "completed", "error": None,
            "incomplete_details": None,
            "output": [{"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                        "content": [{"type": "output_text", "annotations": [], "logprobs": [], "text": "hi there"}]}],
            "usage": {"input_tokens": 7, "output_tokens": 2, "total_tokens": 9}}
RESPONSE_EVENTS = [
    ("response.created", {"type": "response.created", "sequence_number": 0,
                          "response": {**RESPONSE, "status": "in_progress", "output": [], "usage": None}}),
    ("response.output_text.delta", {"type": "response.output_text.delta", "sequence_number": 1, "item_id": "msg_1",
                                    "output_index": 0, "content_index": 0, "delta": "hi", "logprobs": []}),
    ("response.output_text.delta", {"type": "response.output_text.delta", "sequence_number": 2, "item_id": "msg_1",
                                    "output_index": 0, "content_index": 0, "delta": " there", "logprobs": []}),
    ("response.completed", {"type": "response.completed", "sequence_number": 3, "response": RESPONSE}),
]


class MockFrontend:
    """Stands in for the Dynamo frontend; counts the requests of each path. ``models``: what ``/v1/models`` lists."""

    def __init__(self):
        self.models = [MODEL]
        self.hits: dict[str, int] = {}
        self.url = None

    def app(self) -> web.Application:
        app = web.Application()
        for path in ("/v1/completions", "/v1/chat/completions"):
            app.router.add_post(path, self.completion)
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/v1/models/{model:.+}", self.one_model)
        return app

    def _hit(self, request) -> None:
        self.hits[request.path] = self.hits.get(request.path, 0) + 1

    async def _sse(self, request, events) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for name, obj in events:
            await resp.write((f"event: {name}\n" if name else "").encode() + b"data: " + json.dumps(obj).encode()
                             + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def completion(self, request):
        self._hit(request)
        body = await request.json()
        if body.get("model") not in self.models:
            return web.json_response(NOT_FOUND, status=404)
        if body.get("max_tokens") == 0:
            return web.json_response({"message": "Validation: Max tokens must be greater than 0, got 0",
                                      "type": "Bad Request", "code": 400}, status=400)
        if body.get("max_tokens") == 503:
            return web.json_response({"message": "no worker", "type": "Service Unavailable", "code": 503}, status=503)
        if body.get("n") == 2:  # a worker's refusal: the frontend has already said 200
            return await self._sse(request, [(None, REFUSED)])
        return await self._sse(request, [(None, {"error": {"message": "engine crashed", "code": 500}})])

    async def responses(self, request):
        self._hit(request)
        body = await request.json()
        if body.get("model") not in self.models:
            return web.json_response(NOT_FOUND, status=404)
        if body.get("stream"):
            return await self._sse(request, RESPONSE_EVENTS)
        return web.Response(body=json.dumps(RESPONSE, separators=(",", ":")), content_type="application/json")

    async def list_models(self, request):
        return web.json_response({"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]})

    async def one_model(self, request):
        if request.match_info["model"] not in self.models:
            return web.json_response(NOT_FOUND, status=404)
        return web.json_response({"id": request.match_info["model"], "object": "model"})


def run(tmp_path, scenario, *, attempts: int = 3):
    """Run ``scenario(session, proxy_url, frontend, proxy)`` against a fresh mock frontend and proxy."""

    async def go():
        fe = MockFrontend()
        runner = web.AppRunner(fe.app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        fe.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        proxy = Proxy(ProxyConfig(upstream=fe.url, run_id="run", sandbox_id="sb", retry_attempts=attempts,
                                  retry_backoff_s=0.01), str(tmp_path / "store"))
        url = await proxy.start()
        try:
            async with aiohttp.ClientSession() as session:
                return await scenario(session, url, fe, proxy)
        finally:
            await proxy.close(5)
            await runner.cleanup()

    return asyncio.run(go())


async def post(session, url, body, tid="t"):
    """``(status, parsed body or the list of SSE data events, raw text)``."""
    async with session.post(url, json=body, headers={"X-Syncd-Trajectory": tid}) as resp:
        text = await resp.text()
        if resp.content_type == "text/event-stream":
            return resp.status, [json.loads(line[6:]) for line in text.splitlines()
                                 if line.startswith("data: ") and line != "data: [DONE]"], text
        return resp.status, json.loads(text), text


def test_a_model_the_frontend_does_not_list_is_its_404_at_once(tmp_path):
    async def scenario(session, url, fe, proxy):
        for stream in (False, True):
            status, reply, _ = await post(session, f"{url}/v1/chat/completions",
                                          {"model": "nope", "messages": [], "stream": stream})
            assert (status, reply) == (404, NOT_FOUND)
        assert fe.hits["/v1/chat/completions"] == 2  # one attempt each, no retry
        turns = proxy.trajectories["t"].turns
        assert [t.status for t in turns] == ["failed", "failed"] and all(len(t.attempts) == 1 for t in turns)
        assert "HTTP 404" in turns[0].error and "Model not found" in turns[0].error

    run(tmp_path, scenario)


def test_a_404_while_the_frontend_lists_no_model_is_retried(tmp_path):
    async def scenario(session, url, fe, proxy):
        fe.models = []
        status, reply, _ = await post(session, f"{url}/v1/completions", {"model": MODEL, "prompt": "x"})
        assert status == 502 and "no token after 3 attempts" in reply["error"]["message"]
        assert fe.hits["/v1/completions"] == 3

    run(tmp_path, scenario)


def test_a_refused_value_or_option_is_passed_on_at_once_with_the_reason(tmp_path):
    async def scenario(session, url, fe, proxy):
        status, reply, _ = await post(session, f"{url}/v1/completions", {"model": MODEL, "prompt": "x", "n": 2})
        assert (status, reply) == (400, {"message": "this engine does not support n=2", "type": "Bad Request",
                                         "code": 400})  # the frontend's answer to a whole request
        status, events, text = await post(session, f"{url}/v1/completions",
                                          {"model": MODEL, "prompt": "x", "n": 2, "stream": True})
        assert status == 200 and events == [REFUSED] and text.endswith("data: [DONE]\n\n")  # ... to a stream
        status, reply, _ = await post(session, f"{url}/v1/completions", {"model": MODEL, "prompt": "x",
                                                                         "max_tokens": 0})
        assert status == 400 and "Max tokens must be greater than 0" in reply["message"]
        assert fe.hits["/v1/completions"] == 3
        turns = proxy.trajectories["t"].turns
        assert all(t.status == "failed" and len(t.attempts) == 1 for t in turns)
        assert "HTTP 400" in turns[0].error and "does not support n=2" in turns[0].error

    run(tmp_path, scenario)


def test_upstream_failures_are_still_retried(tmp_path):
    async def scenario(session, url, fe, proxy):
        status, reply, _ = await post(session, f"{url}/v1/completions", {"model": MODEL, "prompt": "x",
                                                                         "max_tokens": 503})
        assert status == 502 and "no token after 3 attempts: HTTP 503" in reply["error"]["message"]
        status, reply, _ = await post(session, f"{url}/v1/completions", {"model": MODEL, "prompt": "x"})
        assert status == 502 and "engine crashed" in reply["error"]["message"]  # an error event with code 500
        assert fe.hits["/v1/completions"] == 6

    run(tmp_path, scenario)


def test_model_lookups_pass_through(tmp_path):
    async def scenario(session, url, fe, proxy):
        async with session.get(f"{url}/v1/models/{MODEL}") as resp:
            assert resp.status == 200 and await resp.json() == {"id": MODEL, "object": "model"}
        async with session.get(f"{url}/v1/models/org/other") as resp:
            assert resp.status == 404 and await resp.json() == NOT_FOUND
        assert proxy.trajectories == {}  # a lookup is not a turn

    run(tmp_path, scenario)


def test_a_responses_call_is_passed_on_and_recorded_without_a_token_record(tmp_path):
    async def scenario(session, url, fe, proxy):
        body = {"model": MODEL, "input": "hello", "max_output_tokens": 5}
        status, reply, text = await post(session, f"{url}/v1/responses", body, tid="r")
        assert status == 200 and reply == RESPONSE and text == json.dumps(RESPONSE, separators=(",", ":"))
        status, events, text = await post(session, f"{url}/v1/responses", {**body, "stream": True}, tid="r")
        assert status == 200 and events == [obj for _, obj in RESPONSE_EVENTS]
        assert [line[7:] for line in text.splitlines() if line.startswith("event: ")] == \
            [name for name, _ in RESPONSE_EVENTS]
        status, reply, _ = await post(session, f"{url}/v1/responses", {**body, "model": "nope"}, tid="r")
        assert (status, reply) == (404, NOT_FOUND)
        assert fe.hits["/v1/responses"] == 3
        done = await proxy.finish("r")
        assert done["status"] == "failed" and "no token record" in done["failure"]
        return parse(proxy.store.get(done["key"]))

    rec = run(tmp_path, scenario)
    whole, streamed, refused = rec["turns"]
    for turn, stream in ((whole, False), (streamed, True)):
        assert turn["endpoint"] == "responses" and turn["stream"] is stream and turn["status"] == "failed"
        assert turn["request"]["input"] == "hello" and turn["response_id"] == "resp_1"
        assert turn["text"] == "hi there" and turn["finish_reason"] == "stop" and turn["usage"]["output_tokens"] == 2
        assert turn["output_token_ids"] == [] and turn["segments"] == []
        assert "the 2 output tokens (ids, weight versions, log-probabilities) are not recorded" in turn["error"]
    assert "HTTP 404" in refused["error"]


@pytest.mark.parametrize("final, reason", [
    ({**RESPONSE, "status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"}}, "length"),
    ({**RESPONSE, "output": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "tool_calls"),
])
def test_a_responses_finish_reason_is_recorded_in_the_records_terms(final, reason):
    from syncd.engine.proxy.record import Turn
    from syncd.engine.proxy.responses import _record

    turn = Turn(0, "responses", {}, False)
    _record(turn, final)
    assert turn.finish_reason == reason and turn.status == "running"
    _record(turn, {**RESPONSE, "status": "failed", "error": {"code": "invalid_prompt", "message": "no n=2"}})
    assert turn.status == "failed" and "no n=2" in turn.error
