"""Argument and engine checks of the worker and frontend CLIs (no Dynamo runtime is started)."""

from __future__ import annotations

import pytest

from syncd.engine.dynamo import frontend, worker


class NotAnEngine:
    def generate(self, request):  # a Generator without the Adapter half
        raise NotImplementedError

    def abort(self, request_id):
        pass


def not_an_engine(args):
    return NotAnEngine()


def test_engine_factories_are_checked(model_dir):
    args = worker.parser().parse_args(["--model", str(model_dir), "--engine", f"{__name__}:not_an_engine"])
    with pytest.raises(TypeError, match="does not implement engine.Adapter"):
        worker.build_engine(args)
    for bad in ("nocolon", ":x", "mod:"):
        with pytest.raises(ValueError, match="MODULE:FACTORY"):
            worker.build_engine(worker.parser().parse_args(["--model", str(model_dir), "--engine", bad]))
    ref = worker.build_engine(worker.parser().parse_args(["--model", str(model_dir), "--weights-version", "3"]))
    try:
        assert ref.version == 3 and ref.parameters()
    finally:
        ref.close()


def test_bad_arguments_exit_2(model_dir, capsys):
    assert worker.main(["--model", str(model_dir), "--system-port", "40000"]) == 2
    assert "signed 16-bit" in capsys.readouterr().err
    assert worker.main(["--model", str(model_dir), "--discovery", "etcd"]) == 2
    assert worker.main(["--model", str(model_dir), "--engine", "no.such.module:make"]) == 2
    assert "cannot build the engine" in capsys.readouterr().err
    assert worker.main(["--model", str(model_dir), "--engine", "vllm", "--replay-store", "/tmp/x"]) == 2
    assert "--replay-store needs --run-id" in capsys.readouterr().err
    assert worker.main(["--model", str(model_dir), "--tensor-parallel-size", "2"]) == 2  # the reference engine
    assert worker.main(["--model", str(model_dir), "--engine", "vllm", "--tensor-parallel-size", "0"]) == 2
    assert capsys.readouterr().err.count("--tensor-parallel-size must be") == 2
    assert frontend.main(["--migration-limit", "-1"]) == 2


def test_a_migration_with_no_tokens_left_ends_at_once(model_dir):
    """The frontend re-sends a request whose worker died after its last token but before its stream's end with
    max_tokens 0 (it refuses 0 from clients): the worker ends it with one token-less "length" chunk, which
    the proxy's bookkeeping accepts, where it used to refuse it (the client then saw an error after every
    token had arrived). Other requests are served as before."""
    import asyncio

    from dynamo.llm.exceptions import InvalidArgument

    from syncd.engine.dynamo import protocol
    from syncd.engine.proxy.record import Turn
    from syncd.engine.proxy.turn import TurnState

    ref = worker.build_engine(worker.parser().parse_args(["--model", str(model_dir)]))
    w = worker.DynamoWorker(ref, model_dir=model_dir, served_name="tiny", token="t" * 32)

    async def run(body):
        return [c async for c in w.generate(body)]

    try:
        migrated = {"token_ids": [5, 6, 7, 8], "stop_conditions": {"max_tokens": 0}}
        chunks = asyncio.run(run(migrated))
        assert [(c["token_ids"], c["finish_reason"]) for c in chunks] == [([], "length")]
        state = TurnState(Turn(index=0, endpoint="completions", request={}, stream=True))
        state.add_engine_data(chunks[0]["engine_data"])
        assert state.tokens == 0
        fresh = asyncio.run(run({"token_ids": [5, 6, 7, 8], "stop_conditions": {"max_tokens": 3}}))
        assert [len(c["token_ids"]) for c in fresh] == [1, 1, 1] and fresh[-1]["finish_reason"] == "length"
        # not a migration: no prompt to continue; refused as Dynamo's InvalidArgument, whose message the frontend
        # gives the client (a plain exception reaches it as "Invalid request")
        with pytest.raises(InvalidArgument, match="non-empty"):
            asyncio.run(run({"token_ids": [], "stop_conditions": {"max_tokens": 0}}))
        with pytest.raises(InvalidArgument, match="does not support presence_penalty=0.5"):
            asyncio.run(run({"token_ids": [5], "sampling_options": {"presence_penalty": 0.5}}))
        assert not protocol.nothing_left({"token_ids": [1], "stop_conditions": {"max_tokens": False}})
        assert not protocol.nothing_left({"token_ids": "1", "stop_conditions": {"max_tokens": 0}})
    finally:
        ref.close()


def test_a_taken_system_port_is_named_before_the_model_loads(capsys, tmp_path):
    """The worker checks its --system-port before it builds the engine (which would take long): the model folder
    here does not even exist, and the port is what is refused."""
    import socket

    from syncd.engine.dynamo.procs import MAX_SYSTEM_PORT
    from syncd.procs import free_port

    with socket.socket() as busy:
        port = free_port(below=MAX_SYSTEM_PORT)
        busy.bind(("127.0.0.1", port))
        busy.listen()
        rc = worker.main(["--model", str(tmp_path / "no-model"), "--system-port", str(port)])
    err = capsys.readouterr().err
    assert rc == 2 and f"--system-port {port}" in err and "in use" in err, err


def test_worker_help_uses_the_installed_name_and_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        worker.main(["--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: syncd-dynamo-worker ") and "(default: 8)" in out and "--engine-token-file" in out
    assert "--wait-for-daemon" not in out and "--token-file " not in out  # the default now; one name each


def test_a_worker_no_daemon_manages_says_so(model_dir, monkeypatch, caplog):
    """A registered worker on whom no node daemon took a lease warns that nothing keeps its weights current (never
    routed to silently); one a daemon leases does not."""
    import asyncio
    import logging

    monkeypatch.setattr(worker, "UNMANAGED_WARNING_S", 0.01)
    ref = worker.build_engine(worker.parser().parse_args(["--model", str(model_dir), "--weights-version", "0"]))
    try:
        w = worker.DynamoWorker(ref, model_dir=model_dir, served_name="tiny", token="t" * 32)
        with caplog.at_level(logging.WARNING, logger="syncd.engine.dynamo.worker"):
            asyncio.run(w._warn_if_unmanaged())
        assert any("no node daemon has taken this worker's lease" in r.getMessage() for r in caplog.records)
        caplog.clear()
        w.control.call("lease", {"lease": {"holder": "daemon-0001", "run_id": "r", "pid": 1, "ttl_s": 30}}, "t" * 32)
        with caplog.at_level(logging.WARNING, logger="syncd.engine.dynamo.worker"):
            asyncio.run(w._warn_if_unmanaged())
        assert not caplog.records
    finally:
        ref.close()
