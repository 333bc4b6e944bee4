"""Issue 14 against real processes (a daemon, engine processes, the file store): a hostile store and an
operator's mistakes leave nothing stuck and are said out loud. Cases 1, 2, 9, 10 and 11 (endpoint, bad
variables, a full cache disk); each failed on the code before the issue."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

import pytest

from tests.daemon._hostile import FAR_FUTURE, NESTED_HINT, ModelRun, hint, write_atomic
from tests.daemon._procs import engine_checksums, engine_version, metric, status, status_at
from tests.daemon.conftest import RUN

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def log_of(procs, name: str) -> str:
    return "\n".join(p[2].read_text(errors="replace") for p in procs.children if p[0] == name and p[2].exists())


def serving_version_1(tmp_path, procs, model_dir, run):
    """Versions 0 and 1 published, a headless engine and a daemon (cache ``tmp_path/cache``) on it, the engine at
    version 1: (the engine's URL, the cache)."""
    run.publish(2)
    _, url = procs.engine(model_dir, headless=True)
    cache = tmp_path / "cache"
    procs.daemon(run.root, cache, [url])
    procs.wait(lambda: engine_version(url) == 1, "version 1")
    return url, cache


def test_case1_a_forged_nested_hint_does_not_stop_updates(tmp_path, procs, model_dir, run):
    url, cache = serving_version_1(tmp_path, procs, model_dir, run)
    write_atomic(run.hint_path(), NESTED_HINT)  # "[" * 4096: RecursionError in the old poller, which then died
    procs.wait(lambda: "latest.json hint is unusable" in log_of(procs, "daemon"),  # read as bad data, said so
               "the daemon to read the forged hint")
    time.sleep(10 * 0.1)  # about ten more polls meet it before the publisher overwrites it
    run.publish(2)  # versions 2 and 3; the publisher writes a correct hint again
    procs.wait(lambda: engine_version(url) == 3, "the engine to reach version 3")
    assert engine_checksums(url) == run.checksums(3)
    st = status_at(procs, cache, 3)
    assert st["tasks"]["poller"]["restarts"] == 0 and st["newest_version"] == 3


def test_case2_far_future_garbage_does_not_freeze_the_daemon(tmp_path, procs, model_dir, run):
    url, cache = serving_version_1(tmp_path, procs, model_dir, run)
    write_atomic(run.manifest_path(FAR_FUTURE), b"not a manifest")
    write_atomic(run.hint_path(), hint(FAR_FUTURE))
    procs.wait(lambda: metric(cache, 'syncd_rejected_versions_total{reason="manifest"}') >= 1,
               "the garbage version to be rejected")
    assert status(cache)["newest_version"] == 1  # never a high-water mark
    run.publish(2)
    write_atomic(run.hint_path(), hint(FAR_FUTURE))  # and again after the real publishes
    procs.wait(lambda: engine_version(url) == 3, "the engine to reach version 3 past the garbage")
    assert engine_checksums(url) == run.checksums(3)
    assert status_at(procs, cache, 3)["newest_version"] == 3


def test_case9_a_keyless_reader_refuses_a_signed_run_unless_allowed(tmp_path, procs, model_dir, run):
    run.publish(2)
    _, url = procs.engine(model_dir, headless=True)
    keyless = {"SYNCD_SIGNING_KEY": ""}
    d = procs.daemon(run.root, tmp_path / "cache", [url], env=keyless)
    assert d.wait(timeout=120) == 2, procs.logs()
    err = log_of(procs, "daemon")
    assert "holds signed manifests" in err and "SYNCD_SIGNING_KEY " in err and "SYNCD_SIGNING_KEY_FILE" in err
    assert "--allow-unsigned" in err
    assert engine_version(url) is None  # nothing was loaded unchecked
    verify = procs.cli("verify", "--store", str(run.root), "--run-id", RUN, "--quick", env=keyless)
    assert verify.returncode == 1 and "SYNCD_SIGNING_KEY_FILE" in verify.stdout
    # the operator's explicit choice: read without checking
    procs.daemon(run.root, tmp_path / "cache", [url], env=keyless, extra=["--allow-unsigned"])
    procs.wait(lambda: engine_version(url) == 1, "the engine at version 1 with --allow-unsigned")
    assert engine_checksums(url) == run.checksums(1)


def test_case10_operator_mistakes_are_loud(tmp_path, procs, model_dir, run):
    run.publish(1)
    other = ModelRun(run.root, model_dir, run_id="run-s3")
    other.publish(1)
    other.close()
    _, url = procs.engine(model_dir, headless=True)
    cache = tmp_path / "cache"
    procs.daemon(run.root, cache, [url], run_id="run-b")  # a typo'd --run-id
    want = f"run 'run-b' has no versions in file://{run.root}; runs there: {RUN}, run-s3"
    procs.wait(lambda: status(cache, "run-b")["state"] == "unknown run", "the daemon to say the run is unknown")
    assert status(cache, "run-b")["run_error"] == want
    assert want in log_of(procs, "daemon")
    st = procs.cli("status", "--run-id", "run-b", "--cache-dir", str(cache))
    assert st.returncode == 1 and want in st.stdout
    # a typo'd file:// store path is refused, never created empty and waited on
    missing = tmp_path / "stroe"
    d = procs.daemon(missing, tmp_path / "cache2", [url])
    assert d.wait(timeout=120) == 2 and not missing.exists()
    assert "does not exist" in log_of(procs, "daemon") and "SYNCD_STORE" in log_of(procs, "daemon")
    for command in (["ls"], ["gc", "--dry-run"], ["verify", "--quick"]):
        out = procs.cli(*command, "--store", str(run.root), "--run-id", "NOPE")
        assert out.returncode == 1 and f"runs there: {RUN}, run-s3" in out.stderr, (command, out)
    assert engine_version(url) is None


def test_case11_endpoint_without_scheme_and_bad_variables_are_named(tmp_path, procs):
    out = procs.cli("ls", "--store", "s3://bucket/prefix", "--endpoint", "127.0.0.1:5055")
    assert out.returncode == 2 and "must be a URL with a scheme" in out.stderr and "--endpoint" in out.stderr
    assert "panicked" not in out.stderr and len(out.stderr.splitlines()) == 1
    for var, value in (("SYNCD_POLL_INTERVAL_S", "fast"), ("SYNCD_CACHE_MAX_BYTES", "lots"),
                       ("SYNCD_ENGINE_CHECK_S", "1s"), ("SYNCD_CLUSTER_HEARTBEAT_S", "x")):
        extra = ["--cluster-rank", "0", "--cluster-peers", "0=127.0.0.1:1"] if "CLUSTER" in var else []
        out = procs.cli("--run-id", "r", "--engine", "http://127.0.0.1:1", "--store", str(tmp_path), *extra,
                        env={var: value, "SYNCD_CLUSTER_SECRET": "s" * 32})
        assert out.returncode == 2 and f"{var}={value!r}" in out.stderr, (var, out.stderr)


def _can_mount_in_a_namespace() -> str | None:
    if shutil.which("unshare") is None:
        return "unshare is not installed"
    r = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                       capture_output=True, text=True)
    return None if r.returncode == 0 else f"no unprivileged mount namespaces here: {r.stderr.strip()}"


@pytest.mark.skipif(_can_mount_in_a_namespace() is not None, reason=str(_can_mount_in_a_namespace()))
def test_case11_a_full_cache_disk_is_counted_and_shown_then_recovered(tmp_path, procs, model_dir, run):
    """A real ENOSPC: the daemon and the engine run with the cache on a nearly full tmpfs of their own."""
    import json
    import urllib.request

    run.publish(2)
    cache, ready, release, status_file = (tmp_path / n for n in ("cache", "engine.ready", "release", "status.json"))
    engine = [sys.executable, "-m", "syncd.engine.control_server", "--model", str(model_dir), "--headless", "--port",
              "0", "--ready-file", str(ready)]
    daemon = [sys.executable, "-m", "syncd.app.cli", "--run-id", RUN, "--store", str(run.root),
              "--cache-dir", str(cache),
              "--status-file", str(status_file), "--poll-interval-s", "0.1", "--engine-check-s", "0.2",
              "--metrics-port", "0", "--engine", "e0={url}"]
    procs.spawn("smalldisk", ["-c", "import os,sys; os.execvp('unshare', ['unshare', '-rm', sys.executable, '-m', "
                              "'tests.daemon._small_disk'] + sys.argv[1:])",
                              "--mount", str(cache), "--size", str(512 << 10), "--free", str(4 << 10),
                              "--release", str(release), "--ready", str(ready), "--", *engine, "---", *daemon])
    url = procs.wait(lambda: json.loads(ready.read_text())["url"], "the engine in the namespace", 120)
    st = lambda: json.loads(status_file.read_text())  # noqa: E731
    procs.wait(lambda: "No space left" in (st().get("cache_error") or ""), "the full disk in the status")
    text = urllib.request.urlopen(st()["metrics_url"], timeout=10).read().decode()
    assert 'syncd_failures_total{kind="disk_full"}' in text
    assert float(text.split('syncd_failures_total{kind="disk_full"} ')[1].split()[0]) >= 1
    assert engine_version(url) is None  # nothing half-loaded
    release.touch()  # space is freed
    procs.wait(lambda: engine_version(url) == 1, "the daemon to recover once there is space")
    assert engine_checksums(url) == run.checksums(1)
    procs.wait(lambda: st().get("cache_error") is None, "the cache error to clear")
