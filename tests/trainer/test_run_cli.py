"""``python -m syncd.trainer.run`` refuses a configuration it cannot run with exit status 2 and a message that names the
flag: no engines reachable through the proxy, an unknown task, eta < 0, K < 1, and more; nothing is published.
A data-parallel run (``--nproc``) whose rank dies stops with status 1 and names the rank."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.ft_data import write_offline_plans
from syncd.procs import free_port
from syncd.engine.reference.make_tiny import write_model
from tests.trainer._fake_proxy import FakeProxy
from syncd.trainer.run import main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("cli-model") / "tiny", hidden=32)


@pytest.fixture
def frontend():
    f = FakeProxy()
    yield f
    f.close()


def _run(capsys, model_dir, tmp_path, *flags, proxy=None, store=None):
    argv = ["--model", str(model_dir), "--store", store or (tmp_path / "store").as_uri(), "--run-id", "rl",
            "--out", str(tmp_path / "out"), *(["--proxy", proxy] if proxy else []), *flags]
    rc = main(argv)
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--task", "bogus"], "--task: unknown task 'bogus'; choose one of "),
    (["--max-lag", "-1"], "--max-lag: the staleness bound eta must be >= 0, got -1"),
    (["--every-k", "0"], "--every-k: K must be >= 1, got 0"),
    (["--group-size", "1"], "--group-size: a group needs >= 2 samples"),
    (["--optimizer", "sgd"], "--optimizer: unknown optimizer 'sgd'; choose one of adamw, muon"),
    (["--sync"], "--daemon-status: the synchronous baseline (--sync) waits"),
    (["--lookahead", "1"], "--lookahead: must be >= --groups-per-step (4)"),
    (["--top-p", "0"], "--top-p: must be in (0, 1], got 0.0"),
    (["--top-p", "nan"], "--top-p: must be in (0, 1], got nan"),
    (["--top-k", "-1"], "--top-k: must be >= 0 (0: off), got -1"),
    # non-finite hyper-parameters: before, --lr/--weight-decay 1e999 published NaN weights, --grad-clip nan turned
    # clipping off, --temperature inf failed after 300 s and a negative --rollout-timeout was taken
    (["--lr", "1e999"], "--lr: must be a finite number > 0, got inf"),
    (["--lr", "nan"], "--lr: must be a finite number > 0, got nan"),
    (["--weight-decay", "1e999"], "--weight-decay: must be a finite number >= 0, got inf"),
    (["--weight-decay", "-0.1"], "--weight-decay: must be a finite number >= 0, got -0.1"),
    (["--grad-clip", "nan"], "--grad-clip: must be a finite number >= 0 (0: off), got nan"),
    (["--temperature", "inf"], "--temperature: must be a finite number > 0, got inf"),
    (["--rollout-timeout", "-1"], "--rollout-timeout: must be a finite number of seconds > 0, got -1.0"),
    (["--rollout-timeout", "nan"], "--rollout-timeout: must be a finite number of seconds > 0, got nan"),
    (["--ft-timeout", "-5"], "--ft-timeout: must be a finite number of seconds > 0, got -5.0"),
    # operator mistakes that ended in a traceback
    (["--full-every", "0"], "--full-every: must be >= 1 (1: every version full), got 0"),
    (["--run-id", "../x"], "--run-id: invalid run id '../x'"),
    (["--proxy", "127.0.0.1:8000"], "--proxy '127.0.0.1:8000' has no scheme (did you mean http://127.0.0.1:8000?)"),
    (["--curate", "0.5,0.2"], "--curate/--curate-pool/--curate-confidence: curation band must be 0 <= low < high"),
    (["--curate", "0.05,0.5", "--curate-confidence", "0.3"], "curation confidence must be in (0.5, 1), got 0.3"),
    (["--is-band", "1.5,2"], "--is-cap/--is-band/--is-seq-band/--micro-batch: is_band must be (low, high)"),
    (["--standby"], "--standby: a standby takes a run over from its checkpoints: it needs --resume"),
    (["--standby", "--resume"], "--resume: needs --checkpoint-dir"),
    (["--standby", "--resume", "--checkpoint-dir", "ck", "--lighthouse", "http://127.0.0.1:9"],
     "--standby: is for the plain job"),
    (["--delta-format", "3"], "--delta-format (or SYNCD_DELTA_FORMAT): must be 1 or 2, got '3'"),
    (["--delta-format", "2", "--sliced-tensors", "(q"], "--sliced-tensors: sliced_tensors '(q' is not a regular"),
])
def test_bad_settings_exit_2_naming_the_flag(capsys, model_dir, tmp_path, frontend, flags, message):
    rc, err = _run(capsys, model_dir, tmp_path, *flags, proxy=frontend.url)
    assert rc == 2 and message in err, err
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").rglob("manifest*"))


@pytest.mark.parametrize("store, message", [
    ("s4://bucket/rl", "--store (or SYNCD_STORE): unsupported store URL scheme 's4'"),
    ("htps://bucket/rl", "--store (or SYNCD_STORE): unsupported store URL scheme 'htps'"),
    ("s3:/bucket/rl", "--store (or SYNCD_STORE): 's3:/bucket/rl' looks like a URL missing the '//' after its scheme"),
])
def test_a_mistyped_store_url_exits_2_naming_the_flag(capsys, model_dir, tmp_path, frontend, store, message):
    rc, err = _run(capsys, model_dir, tmp_path, proxy=frontend.url, store=store)
    assert rc == 2 and message in err, err
    assert "Traceback" not in err and not (Path.cwd() / "s3:").exists()


def test_a_new_local_store_folder_is_created_the_publisher_owns_the_run(model_dir, tmp_path, frontend):
    """Before, ``has_versions`` opened the store as a reader (never creating it): a brand-new ``file://`` store could
    not be started at all. An offline run (``--plans``) reads records that must be there: its store is not created."""
    from syncd.trainer.rl.config import ConfigError
    from syncd.trainer.run import _preflight, config_from_args, parser

    store = tmp_path / "new" / "store"
    base = ["--model", str(model_dir), "--run-id", "rl", "--out", str(tmp_path / "out")]
    _preflight(config_from_args(parser().parse_args([*base, "--store", store.as_uri(), "--proxy", frontend.url])))
    assert store.is_dir()
    plans = tmp_path / "plans.jsonl"
    plans.write_text("{}\n")
    missing = tmp_path / "missing"
    with pytest.raises(ConfigError, match=r"--store \(or SYNCD_STORE\): .* does not exist"):
        _preflight(config_from_args(parser().parse_args([*base, "--store", missing.as_uri(), "--plans", str(plans),
                                                         "--steps", "1"])))
    assert not missing.exists()


def test_no_engines_reachable(capsys, model_dir, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    rc, err = _run(capsys, model_dir, tmp_path, proxy=dead)
    assert rc == 2 and f"--proxy: no engines reachable through {dead}" in err and "ConnectionRefusedError" in err
    empty = FakeProxy(models=[])
    try:
        rc, err = _run(capsys, model_dir, tmp_path, proxy=empty.url)
    finally:
        empty.close()
    assert rc == 2 and "lists no model (no engine serving)" in err, err
    rc, err = _run(capsys, model_dir, tmp_path)
    assert rc == 2 and "--proxy: at least one proxy URL is needed" in err


def test_missing_store_model_or_plans(capsys, model_dir, tmp_path, frontend, monkeypatch):
    monkeypatch.delenv("SYNCD_STORE", raising=False)
    rc = main(["--model", str(model_dir), "--run-id", "rl", "--out", str(tmp_path), "--proxy", frontend.url])
    assert rc == 2 and "--store is required" in capsys.readouterr().err
    rc, err = _run(capsys, tmp_path, tmp_path, proxy=frontend.url)
    assert rc == 2 and "--model:" in err and "no config.json" in err
    rc, err = _run(capsys, model_dir, tmp_path, "--plans", str(tmp_path / "none.jsonl"), "--steps", "3")
    assert rc == 2 and "--plans:" in err, err


def test_a_run_that_already_has_versions_is_refused(capsys, model_dir, tmp_path, frontend):
    from syncd.publish.publisher import WeightPublisher

    store = (tmp_path / "store").as_uri()
    with WeightPublisher(store, "rl", signing_key=False) as pub:
        pub.publish({"w": __import__("torch").zeros(4)}, 0)
    rc, err = _run(capsys, model_dir, tmp_path, proxy=frontend.url, store=store)
    assert rc == 2 and "--run-id: run rl already has versions" in err, err


def test_curate_flags_put_the_difficulty_filter_on_the_loop():
    from syncd.trainer.run import config_from_args, parser

    base = ["--model", "m", "--out", "o"]
    assert config_from_args(parser().parse_args(base)).curation is None
    cfg = config_from_args(parser().parse_args([*base, "--curate", "0.1,0.6", "--curate-pool", "16"]))
    assert cfg.curation.band == (0.1, 0.6) and cfg.curation.pool == 16 and cfg.curation.confidence == 0.9


def test_delta_format_flags_and_variables_reach_the_loop(capsys, model_dir, tmp_path, frontend, monkeypatch):
    from syncd.trainer.run import config_from_args, parser

    base = ["--model", "m", "--out", "o"]
    cfg = config_from_args(parser().parse_args(base))
    assert (cfg.delta_format, cfg.sliced_tensors) == (1, None)
    monkeypatch.setenv("SYNCD_DELTA_FORMAT", "2")
    monkeypatch.setenv("SYNCD_SLICED_TENSORS", r".*o_proj.*")
    cfg = config_from_args(parser().parse_args(base))
    assert (cfg.delta_format, cfg.sliced_tensors) == (2, r".*o_proj.*")
    assert config_from_args(parser().parse_args([*base, "--delta-format", "1"])).delta_format == 1  # flag wins
    monkeypatch.setenv("SYNCD_DELTA_FORMAT", "two")
    rc, err = _run(capsys, model_dir, tmp_path, proxy=frontend.url)
    assert rc == 2 and "--delta-format (or SYNCD_DELTA_FORMAT): must be 1 or 2, got 'two'" in err, err


@pytest.mark.integration
def test_a_rank_killed_stops_the_run_and_is_named(tmp_path):
    """``--nproc 2``: kill -9 of rank 1 (as soon as it starts; rank 0 waits for it to join the group) ends the run
    with exit status 1 and a line naming the rank and its signal."""
    model = write_model(tmp_path / "model", hidden=32)
    store = (tmp_path / "store").as_uri()
    plans = write_offline_plans(model, store, "rk", tmp_path / "plans.jsonl", steps=2, groups=2, group_size=2,
                                distinct=2)
    argv = [sys.executable, "-m", "syncd.trainer.run", "--model", str(model), "--store", store, "--run-id", "rk",
            "--plans", str(plans), "--steps", "2", "--groups-per-step", "2", "--group-size", "2",
            "--out", str(tmp_path / "out"), "--no-plot", "--nproc", "2"]
    p = subprocess.Popen(argv, cwd=Path(__file__).resolve().parents[2], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        children = Path(f"/proc/{p.pid}/task/{p.pid}/children")
        deadline = time.monotonic() + 120
        while not children.read_text().split():  # the launcher starts rank 1 before its own rank joins
            assert p.poll() is None and time.monotonic() < deadline, "rank 1 never started"
            time.sleep(0.01)
        os.kill(int(children.read_text().split()[0]), signal.SIGKILL)
        _, err = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 1, err[-3000:]
    assert "syncd.trainer.run: rank 1 exited with signal SIGKILL; stopping the run" in err, err[-3000:]


def test_an_out_folder_that_cannot_be_written_is_named_before_the_run(capsys, model_dir, tmp_path, frontend):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    rc = main(["--model", str(model_dir), "--store", (tmp_path / "store").as_uri(), "--run-id", "rl",
               "--out", str(blocker / "out"), "--proxy", frontend.url])
    err = capsys.readouterr().err
    assert rc == 2 and f"--out: cannot write to {blocker / 'out'}" in err, err


def test_help_names_the_command_and_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: syncd train ") and "(default: 8)" in out  # --task-length
