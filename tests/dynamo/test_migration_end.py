"""A worker that dies after streaming a request's last token but before its stream's end: the frontend migrates
the request with max_tokens 0 (every token already made), and the client still gets every token and a normal
end, not an error. Real frontend and workers (``syncd.engine.dynamo.serve.Node``); the dying engine is the reference
engine killing its own process (``tests.dynamo._dying_engine``)."""

from __future__ import annotations

import uuid

import pytest

from syncd.procs import wait_until
from syncd.engine.dynamo.node import Node, NodeConfig
from syncd.engine.dynamo.settings import DynamoSettings
from tests.dynamo._client import finish_reason, post_stream
from tests.dynamo._dying_engine import DIE_SEED

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_death_after_the_last_token_ends_the_stream_normally(model_dir, tmp_path):
    cfg = NodeConfig(model=model_dir, run_dir=tmp_path / "node", workers=2, frontend=True, migration_limit=3,
                     settings=DynamoSettings(file_kv=tmp_path / "kv", namespace=f"t{uuid.uuid4().hex[:8]}"),
                     worker_args=("--engine", "tests.dynamo._dying_engine:make", "--weights-version", "0"),
                     startup_timeout_s=240, managed=False)  # no daemon: workers serve the folder's weights
    node = Node(cfg).start()
    node.supervise(background=True)
    try:
        pids = {w["pid"] for w in node.workers()}
        body = {"model": cfg.model_name, "prompt": "the last token", "max_tokens": 12, "seed": DIE_SEED,
                "temperature": 1.0, "ignore_eos": True, "nvext": {"extra_fields": ["engine_data"]}}
        status, _, events = post_stream(f"{node.frontend_url}/v1/completions", body)
        assert status == 200, events
        assert not [ev for ev in events if "error" in ev], events
        tokens = [t for ev in events for t in ev.get("nvext", {}).get("engine_data", {}).get("token_ids", [])]
        assert len(tokens) == 12 and finish_reason(events) == "length", events
        # a worker really died after the stream (the supervisor restarts it)
        wait_until(lambda: {w["pid"] for w in node.workers()} != pids, 60, "the dying worker to be replaced")
    finally:
        node.close()
