"""Sandbox escapes, each tried for real in the jail (``syncd.trainer.agent.sandbox``): network access (the internet
and the host's 127.0.0.1), reading outside the working copy, writing to the grader's copy (directly, through a
link, or later from a process left behind), a fork bomb, a runaway process that ignores SIGTERM, a call that never
returns, too much output, memory and disk. CI runs as root, where the namespaces exist; the fallback without them
is checked by forcing it."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time

import pytest

from syncd.trainer.agent import sandbox as sbx
from syncd.trainer.agent.sandbox import Limits, Sandbox, SandboxUnavailable

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the jail needs root (CI runs as root); "
                                "test_without_namespaces_the_fallback_is_refused_or_stated covers the rest")

SLACK_S = 10.0  # a busy machine


@pytest.fixture
def sb(tmp_path):
    assert sbx.isolation() == "namespaces", "root here, so the namespaces must work"
    s = Sandbox.create({"pkg/mod.py": "def f(x):\n    return x + 1\n", "tests/test_mod.py": "assert True\n"},
                       limits=Limits(timeout_s=3, cpu_s=5), parent=tmp_path)
    yield s
    s.close()


def _uid_processes(uid: int) -> list[str]:
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    out.append(pid)
            except FileNotFoundError:
                pass
    return out


def test_the_working_copy_has_no_history_no_reference_and_no_links(tmp_path):
    src = tmp_path / "repo"
    (src / ".git" / "objects").mkdir(parents=True)
    (src / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (src / "hidden_tests").mkdir()
    (src / "hidden_tests" / "test_hidden.py").write_text("secret\n")
    (src / "solution.py").write_text("the fix\n")
    (src / "pkg").mkdir()
    (src / "pkg" / "mod.py").write_text("x = 1\n")
    (src / "pkg" / "link").symlink_to("/etc/passwd")
    with Sandbox.create(src, parent=tmp_path) as s:
        r = s.run("find . | sort; id -u")
        assert r.ok, r.text()
        listed = r.stdout.split()
        assert listed[:-1] == [".", "./pkg", "./pkg/mod.py"]
        assert int(listed[-1]) == s.uid != 0
        assert s.describe()["network"] == "restricted"


def test_no_network_not_even_the_hosts_loopback(sb):
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    accepted = []
    threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
    try:
        for target in (f"('127.0.0.1', {port})", "('1.1.1.1', 80)"):
            r = sb.run(f"python3 -c \"import socket; socket.create_connection({target}, timeout=2); print('IN')\"")
            assert r.exit_code != 0 and "IN" not in r.stdout, r.text()
            assert "unreachable" in r.stderr or "refused" in r.stderr, r.stderr
        r = sb.run("cat /etc/resolv.conf >/dev/null 2>&1; python3 -c \"import socket; "
                   "print(socket.getaddrinfo('example.com', 80))\"")
        assert r.exit_code != 0
        time.sleep(0.2)
        assert not accepted
    finally:
        server.close()


def test_nothing_outside_the_working_copy_can_be_read(sb, tmp_path):
    hidden = tmp_path / "hidden_tests" / "expected.json"
    hidden.parent.mkdir()
    hidden.write_text('{"answer": 42}')
    r = sb.run(f"cat {hidden}; cat ../hidden_tests/expected.json; ls /root; cat /proc/1/root/{hidden}; "
               f"find / -name expected.json 2>/dev/null")
    assert "42" not in r.stdout, r.text()
    assert "No such file" in r.stderr


def test_the_graders_copy_cannot_be_written(sb, tmp_path):
    grader = tmp_path / "grader-copy"
    # a process left behind to change the working copy after the agent's last call, and a link to the host
    r = sb.run("(sleep 1; echo pwned > pkg/mod.py) >/dev/null 2>&1 & ln -s /etc/passwd pkg/passwd; echo left")
    assert r.ok and "left" in r.stdout
    final = sb.snapshot(grader)
    r = sb.run(f"echo pwned > {grader}/pkg/mod.py; echo pwned > ../grader-copy/pkg/mod.py; ls {grader}")
    assert r.exit_code != 0
    time.sleep(1.5)
    assert (final / "pkg" / "mod.py").read_text() == "def f(x):\n    return x + 1\n"
    assert (sb.work / "pkg" / "mod.py").read_text() == "def f(x):\n    return x + 1\n"  # the writer died too
    assert not (final / "pkg" / "passwd").exists() and not (final / "pkg" / "passwd").is_symlink()


def test_a_fork_bomb_is_contained_and_nothing_survives_the_call(sb):
    # the shell execs the second bomb: forking it could fail once the first fills the process limit, which
    # would end the call early with the shell's "cannot fork" instead of reaching the time limit
    r = sb.run("bash -c ':(){ :|:& };:'; exec python3 -c \"import os\nwhile True:\n  try: os.fork()\n"
               "  except OSError: pass\"", timeout_s=3)
    assert r.killed == "timeout" and r.wall_s < 3 + SLACK_S, r
    assert _uid_processes(sb.uid) == []
    assert subprocess.run(["true"]).returncode == 0  # the host still forks


def test_a_runaway_process_and_a_call_that_never_returns_are_killed(sb):
    for cmd in ("sleep 1000", "trap '' TERM INT; setsid sleep 1000 & nohup sleep 1000 & while :; do :; done"):
        t0 = time.monotonic()
        r = sb.run(cmd, timeout_s=2)
        assert r.killed == "timeout" and r.exit_code is None, r
        assert time.monotonic() - t0 < 2 + SLACK_S
        assert _uid_processes(sb.uid) == []
        assert "[killed: no result after" in r.text()


def test_output_memory_and_disk_are_bounded(sb):
    r = sb.run("yes")
    assert r.killed == "output" and len(r.stdout) == sb.limits.output_bytes and r.truncated
    r = sb.run("python3 -c 'x = bytearray(4 << 30)'")
    assert r.exit_code == 1 and "MemoryError" in r.stderr
    r = sb.run("dd if=/dev/zero of=big bs=1M count=64 2>&1; for i in 1 2 3 4 5 6 7 8 9; do "
               "head -c 8000000 /dev/zero > f$i || echo FULL; done; du -sm . | cut -f1")
    assert int(r.stdout.split()[-1]) <= sb.limits.disk_bytes >> 20
    assert "FULL" in r.stdout


def test_a_command_with_a_nul_byte_fails_as_a_command(sb):
    r = sb.run("echo a\0b")
    assert r.exit_code == 2 and "NUL" in r.stderr


def test_without_namespaces_the_fallback_is_refused_or_stated(monkeypatch, tmp_path):
    monkeypatch.setattr(sbx, "isolation", lambda: "none")
    with pytest.raises(SandboxUnavailable, match="allow_unisolated"):
        Sandbox.create({"a": "1"}, parent=tmp_path)
    with Sandbox.create({"a": "1\n"}, parent=tmp_path, allow_unisolated=True, limits=Limits(timeout_s=2)) as s:
        assert s.describe()["network"] == "open" and s.describe()["isolation"] == "none"
        r = s.run("cat a; id -u")
        assert r.ok and r.stdout.split() == ["1", str(s.uid)]
        assert s.run("sleep 100").killed == "timeout"
