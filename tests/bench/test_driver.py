"""The benchmark driver (``python -m bench``): routines found by convention and listed, a routine run through the
driver printing the shared columns and writing them to its JSON, ``--refcheck`` failing the run when a check
fails, and test lists (``bench/gpu_checks.txt`` among them) parsed, checked and run, all on the CPU."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from bench import _checks, _driver, codec
from bench._report import COLUMNS, Row, finish, output_flags

ROOT = Path(__file__).resolve().parents[2]
GPU_JSON = {"gpu_codec.json", "gpu_codec_d10.json", "gpu_nvfp4.json", "gpu_replay.json", "engine_update_gpu.json"}


def test_list_names_every_routine_and_no_helper(capsys):
    assert _driver.main(["--list"]) == 0
    printed = capsys.readouterr().out
    names = [line.split()[0] for line in printed.splitlines()]
    assert names == sorted(names) and {"codec", "engine_update", "gpu_codec", "replay", "trainer_ft"} <= set(names)
    assert not {"rollouts", "engine_update_vllm", "ft_goodput", "replay_kept", "_timing"} & set(names)
    assert "Codec benchmark on real RL-like weight deltas" in printed


def test_every_routine_takes_the_shared_output_flags():
    for name in _driver.routines():
        mod = importlib.import_module(f"bench.{name}")
        flags = {s for a in mod.parser()._actions for s in a.option_strings}
        assert {"--json", "--plot"} <= flags, name
        assert not {"--out", "--png"} & flags, name
        assert callable(mod.main)


def _codec_argv(out: Path, *extra: str) -> list[str]:
    return ["--routine", "codec", "--preset", "tiny", "--lrs", "1e-5", "--ks", "1", "--repeats", "1",
            "--json", str(out), *extra]


def test_a_routine_through_the_driver_prints_and_writes_the_shared_columns(tmp_path, capsys):
    out = tmp_path / "codec.json"
    assert _driver.main(_codec_argv(out, "--refcheck")) == 0
    printed = capsys.readouterr().out
    header = next(line for line in printed.splitlines() if line.startswith("routine"))
    assert header.split() == list(COLUMNS)
    data = json.loads(out.read_text())
    assert data["bench"] == "codec" and data["results"][0]["formats"]["2"]["refcheck"] is True  # its own fields kept
    table = data["table"]
    assert [r["backend"] for r in table] == ["format 1 encode", "format 1 apply", "format 2 encode", "format 2 apply"]
    for r in table:
        assert set(r) == set(COLUMNS) and r["routine"] == "codec" and r["device"] == "cpu"
        assert r["seconds"] > 0 and r["ratio"] > 0 and r["baseline"] == "NumPy read pass" and r["refcheck"] is True


def test_a_failed_refcheck_fails_the_routine(tmp_path, capsys, monkeypatch):
    """codec --refcheck decodes with the reference backend: a reference that disagrees fails the run (exit 1)."""
    decode = codec.delta.decode

    def wrong_reference(old, blob, *, backend="auto", **kw):
        got = decode(old, blob, backend=backend, **kw)
        if backend == "reference":
            got.view(-1).view(torch.int16)[0] ^= 1
        return got

    monkeypatch.setattr(codec.delta, "decode", wrong_reference)
    out = tmp_path / "codec.json"
    assert _driver.main(_codec_argv(out, "--refcheck")) == 1
    assert "REFCHECK FAILED: format 1 encode" in capsys.readouterr().err
    assert {r["refcheck"] for r in json.loads(out.read_text())["table"]} == {False}
    assert _driver.main(_codec_argv(out)) == 0  # not asked: not checked
    assert {r["refcheck"] for r in json.loads(out.read_text())["table"]} == {None}


def _stub_routine(ok: bool) -> types.ModuleType:
    """A routine of the convention (``parser``, ``main`` ending in ``finish``) whose check passes or fails."""
    import argparse

    mod = types.ModuleType("bench.stub")

    def parser():
        p = argparse.ArgumentParser(prog="python -m bench.stub")
        p.add_argument("--n", type=int, default=3)
        output_flags(p, "stub", refcheck="compare with the stub's reference")
        return p

    def main(argv=None):
        args = parser().parse_args(argv)
        rows = [Row("stub", 0.5, 2.0, "twice the work", f"n={args.n}", refcheck=ok if args.refcheck else None)]
        return finish("stub", args, {"bench": "stub", "n": args.n}, rows)

    mod.parser, mod.main = parser, main
    return mod


@pytest.mark.parametrize("ok", [True, False])
def test_the_driver_returns_a_stubbed_routines_refcheck(tmp_path, capsys, monkeypatch, ok):
    monkeypatch.setitem(sys.modules, "bench.stub", _stub_routine(ok))
    monkeypatch.setattr(_driver, "routines", lambda: {"stub": "a stub"})
    out = tmp_path / "stub.json"
    assert _driver.main(["--routine", "stub", "--n", "5", "--json", str(out)]) == 0  # no --refcheck: '-'
    assert _driver.main(["-R", "stub", "--refcheck", f"--json={out}"]) == (0 if ok else 1)
    data = json.loads(out.read_text())
    assert data["n"] == 3 and data["table"] == [{"routine": "stub", "backend": "stub", "device": "cpu", "sizes": "n=3",
                                                 "seconds": 0.5, "ratio": 2.0, "baseline": "twice the work",
                                                 "refcheck": ok}]
    captured = capsys.readouterr()
    assert ("REFCHECK FAILED" in captured.err) is not ok
    assert "2.00x" in captured.out and ("ok" if ok else "FAIL") in captured.out
    assert _driver.main(["--routine", "nope"]) == 2


def test_test_list_syntax():
    text = """# a comment

== first heading
pytest tests/ops -k "not asan" > ops.log
--routine codec --preset tiny --json {out}/c.json
== second
pytest tests/bench/test_timing.py
"""
    checks = _checks.parse(text, "list.txt")
    assert [(c.kind, c.args, c.log, c.title, c.line) for c in checks] == [
        ("pytest", ("tests/ops", "-k", "not asan"), "ops.log", "first heading", 4),
        ("routine", ("codec", "--preset", "tiny", "--json", "{out}/c.json"), None, "first heading", 5),
        ("pytest", ("tests/bench/test_timing.py",), None, "second", 7)]
    assert _checks.command(checks[1], Path("/r"), "py") == ["py", "-m", "bench", "--routine", "codec", "--preset",
                                                             "tiny", "--json", "/r/c.json"]
    assert _checks.command(checks[0], Path("/r"), "py") == ["py", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                                             "tests/ops", "-k", "not asan"]
    for bad, why in (("make all", "list.txt:1: a check starts with --routine or pytest"),
                     ("--routine", "list.txt:1: --routine needs a routine name"),
                     ("pytest x > a b", "list.txt:1: '>' takes one log file name"),
                     ('pytest "x', "list.txt:1: No closing quotation")):
        with pytest.raises(ValueError, match=why):
            _checks.parse(bad, "list.txt")


def test_the_gpu_list_checks_out_on_the_cpu(capsys):
    """Every line of bench/gpu_checks.txt names a routine whose parser takes its flags, or test paths that exist;
    the JSON goes where bench/gpu_check.sh wrote it before; the wrapper runs the list."""
    path = ROOT / "bench" / "gpu_checks.txt"
    assert _driver.main(["--tests", str(path), "--dry-run"]) == 0
    checks = _checks.load(path)
    written = {Path(c.args[c.args.index("--json") + 1]) for c in checks if c.kind == "routine"}
    assert {p.parent for p in written} == {Path("{out}")} and {p.name for p in written} == GPU_JSON
    assert {c.args[0] for c in checks if c.kind == "routine"} == {"gpu_codec", "gpu_nvfp4", "gpu_replay",
                                                                   "engine_update"}
    assert all(c.log for c in checks if c.kind == "pytest")
    wrapper = (ROOT / "bench" / "gpu_check.sh").read_text()
    assert '"$py" -m bench --tests bench/gpu_checks.txt --results "$out"' in wrapper


def test_run_goes_on_after_a_failure_and_reports_it(tmp_path, capsys):
    checks = _checks.parse("== one\npytest a.py > a.log\n--routine codec --json {out}/x.json\n== two\n"
                           "--routine nvfp4\n", "l")
    ran = []

    def runner(argv, log):
        ran.append((argv, log))
        if log is not None:
            log.write_text("".join(f"line {i}\n" for i in range(30)))
        return 1 if "codec" in argv else 0

    assert _checks.run(checks, tmp_path / "res", python="py", runner=runner, tail=3) == 1
    assert [a[1] for a in ran] == [tmp_path / "res" / "a.log", None, None]
    assert ran[1][0][-2:] == ["--json", str(tmp_path / "res" / "x.json")]
    printed = capsys.readouterr().out
    assert "== one" in printed and "== two" in printed and "line 29" in printed and "line 26" not in printed
    assert "2 of 3 checks passed" in printed and "FAIL 1" in printed
    assert _checks.run(checks[:1], tmp_path / "res", runner=runner) == 0


@pytest.mark.slow
def test_tests_run_each_check_in_its_own_process(tmp_path):
    """``python -m bench --tests``: a routine line writes its JSON under --results, a pytest line its log; a failing
    check makes the run fail but the others still run."""
    lst = tmp_path / "list.txt"
    lst.write_text("== a routine\n--routine projection --sample-mib 1 --densities 0.01 --repeats 1 "
                   "--hop-overhead-s 0.005 --json {out}/p.json\n== tests\n"
                   "pytest tests/bench/test_timing.py > t.log\n"
                   "pytest tests/bench/test_timing.py -k no_such_test > none.log\n")
    res = tmp_path / "res"
    p = subprocess.run([sys.executable, "-m", "bench", "--tests", str(lst), "--results", str(res)], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 1, p.stdout + p.stderr
    assert json.loads((res / "p.json").read_text())["table"][0]["routine"] == "projection"
    assert "passed" in (res / "t.log").read_text()
    assert "2 of 3 checks passed" in p.stdout
    q = subprocess.run([sys.executable, "-m", "bench.projection", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert q.returncode == 0 and "--json PATH" in q.stdout and "--plot PNG" in q.stdout


def test_gpu_routines_rows_from_their_json():
    """The GPU routines' shared columns, from results shaped as they write them (their timing needs a GPU)."""
    from bench import gpu_codec, gpu_nvfp4, gpu_replay

    nb = 1 << 30
    codec_res = {"device": "H100", "bytes": nb, "density": 0.01, "copy_gbps": 2 * nb / 1e9 / 0.001, "backends": {
        "cuda": {"checksum_gbps": nb / 1e9 / 0.001, "scan_gbps": 2 * nb / 1e9 / 0.002,
                 "formats": {"1": {"encode_gbps": nb / 1e9 / 0.004, "apply_gbps": nb / 1e9 / 0.002, "refcheck": True},
                             "2": {"encode_gbps": nb / 1e9 / 0.004, "apply_gbps": nb / 1e9 / 0.002,
                                   "refcheck": False}}}}}
    rows = gpu_codec.rows(codec_res)
    assert [r.backend for r in rows] == ["cuda checksum", "cuda scan", "cuda format 1 encode", "cuda format 1 apply",
                                         "cuda format 2 encode", "cuda format 2 apply"]
    assert [round(r.ratio, 6) for r in rows] == [1, 0.5, 0.25, 0.5, 0.25, 0.5]
    assert [r.refcheck for r in rows] == [None, None, True, True, False, False] and rows[0].device == "H100"
    nv = {"device": "H100", "bytes": nb, "copy_gbps": 2 * nb / 1e9 / 0.001, "backends": {"triton": {
        "quantize_gbps": nb / 1e9 / 0.002, "quantize_pts_gbps": nb / 1e9 / 0.001, "dequantize_gbps": nb / 1e9 / 0.001,
        "refcheck": True}}}
    assert [(r.backend, round(r.ratio, 6), r.refcheck) for r in gpu_nvfp4.rows(nv)] == [
        ("triton quantize", 0.5, True), ("triton quantize_pts", 1, True), ("triton dequantize", 1, True)]
    rp = {"rows": 8, "vocab": 16, "dtype": "bfloat16", "gpu": "H100", "triton_s": 0.01, "speedup": 4.0,
          "rebuild_s": 0.005, "rebuild_fraction_of_kept_logprobs": 0.5}
    assert [r.refcheck for r in gpu_replay.rows(rp)] == [None, None]
    rp.update(max_abs_err=1e-3, rebuild_refcheck=True)
    assert [(r.ratio, r.refcheck) for r in gpu_replay.rows(rp)] == [(4.0, False), (2.0, True)]
