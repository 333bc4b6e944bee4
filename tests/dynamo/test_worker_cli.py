"""Argument and engine checks of the worker and frontend CLIs (no Dynamo runtime is started)."""

from __future__ import annotations

import pytest

from engine.dynamo import frontend, worker


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
    assert worker.main(["--model", str(model_dir), "--wait-for-daemon", "--weights-version", "0"]) == 2
    assert "drop --weights-version" in capsys.readouterr().err
    assert worker.main(["--model", str(model_dir), "--engine", "vllm", "--replay-store", "/tmp/x", "--run-id", "r"]) == 2
    assert "Model Runner V2" in capsys.readouterr().err
    assert worker.main(["--model", str(model_dir), "--tensor-parallel-size", "2"]) == 2  # the reference engine
    assert worker.main(["--model", str(model_dir), "--engine", "vllm", "--tensor-parallel-size", "0"]) == 2
    assert capsys.readouterr().err.count("--tensor-parallel-size must be") == 2
    assert frontend.main(["--migration-limit", "-1"]) == 2
