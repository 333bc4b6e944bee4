"""Replicas under attack and under load, on real sockets, real disks and real processes (issue 40, A.5, A.6, A.9,
A.11): every transfer needs the job's token; a replica is trusted only as its owner recorded it; another run's
checkpoints and replicas are refused with both run ids named; one slow peer holds up no other peer's transfer and is
cut off at its deadline, on either side; a holder killed mid-transfer leaves no partial folder once it starts
again; a checkpoint folder named for one step but holding another is never taken for that step."""

from __future__ import annotations

import http.client
import json
import logging
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from syncd.trainer.ft.checkpoint import Checkpointer, list_steps, newest_checkpoint, step_dir
from syncd.trainer.ft.ckpt_format import MANIFEST, RunMismatch, frame_prefix, manifest_digest
from syncd.trainer.ft.fault_tolerance import FaultTolerance, FTConfig
from syncd.trainer.ft.peers import PeerDirectory, rebuild_from_peers
from syncd.trainer.ft.replica_server import ReplicaServer
from syncd.trainer.ft.replica_wire import ReplicaError, replica_token
from syncd.trainer.ft.replicas import fetch_checkpoint, list_replicas, push_replica

ROOT = Path(__file__).resolve().parents[3]
TOKEN = replica_token("5e" * 32, "run")


def _checkpoint(root, *, owner="rank-0", steps=2, run_id="run", seed=0, width=64):
    torch.manual_seed(seed)
    m = torch.nn.Linear(width, 32)
    ck = Checkpointer(root, owner=owner, keep=steps, on_busy="wait", run_id=run_id)
    for s in range(1, steps + 1):
        with torch.no_grad():
            m.weight.add_(1.0)
        ck.save(s, m, None, state={"step": s}, wait=True)
    ck.close()
    return m


def _frame(path: Path) -> bytes:
    raw = (path / MANIFEST).read_bytes()
    return frame_prefix(raw) + raw + b"".join((path / n).read_bytes() for n in sorted(json.loads(raw)["files"]))


@pytest.fixture
def servers(tmp_path):
    made = []

    def make(name, **kw):
        made.append(ReplicaServer(tmp_path / name / "held", **{"keep": 2, "token": TOKEN, "run_id": "run", **kw}))
        return made[-1]

    yield make
    for s in made:
        s.close(timeout=5)


def test_every_transfer_needs_the_job_token(tmp_path, servers):
    own = tmp_path / "own"
    _checkpoint(own, steps=1)
    a = servers("a")
    for token in (None, replica_token("ab" * 32, "run"), replica_token("5e" * 32, "another-run")):
        with pytest.raises(ReplicaError, match="HTTP 401 .*needs the job's token"):
            push_replica(a.url, step_dir(own, 1), owner="rank-0", step=1, token=token)
        with pytest.raises(ReplicaError, match="HTTP 401"):
            list_replicas(a.url, "rank-0", token=token)
    assert a.unauthorized == 6 and list_steps(a.root / "rank-0") == []  # nothing landed
    push_replica(a.url, step_dir(own, 1), owner="rank-0", step=1, token=TOKEN)
    assert list_replicas(a.url, "rank-0", token=TOKEN) == [1]
    with pytest.raises(ReplicaError, match="HTTP 401"):
        fetch_checkpoint(a.url, "rank-0", 1)


def test_a_replica_its_owner_did_not_record_is_never_loaded(tmp_path, servers, caplog):
    """Whoever pushes a replica -- even with the token -- it is loaded only if its manifest is the one its owner
    recorded in the store: a forged one at the first holder is skipped for the genuine one at the second."""
    own, forged = tmp_path / "own", tmp_path / "forged"
    m = _checkpoint(own, steps=1)
    _checkpoint(forged, steps=1, seed=7)  # an attacker's weights under the same owner and step
    a, b = servers("a"), servers("b")
    push_replica(a.url, step_dir(forged, 1), owner="rank-0", step=1, token=TOKEN)
    push_replica(b.url, step_dir(own, 1), owner="rank-0", step=1, token=TOKEN)
    d = PeerDirectory(f"file://{tmp_path / 'store'}", "run")
    d.announce("a", a.url, "n1")
    d.announce("b", b.url, "n2")
    with caplog.at_level(logging.WARNING, "syncd.trainer.ft.peers"):
        assert rebuild_from_peers("rank-0", ["a", "b"], d, token=TOKEN, run_id="run") is None  # nothing recorded
    assert "no record of its checkpoints" in caplog.text
    d.record("rank-0", {1: manifest_digest((step_dir(own, 1) / MANIFEST).read_bytes())})
    with caplog.at_level(logging.WARNING, "syncd.trainer.ft.peers"):
        _, c, holder = rebuild_from_peers("rank-0", ["a", "b"], d, token=TOKEN, run_id="run")
    assert holder == "b" and all(torch.equal(c.model[k], v) for k, v in m.state_dict().items())
    assert "held by a skipped" in caplog.text and "not the one its owner recorded" in caplog.text


def test_another_runs_checkpoints_and_replicas_are_refused_naming_both_ids(tmp_path, servers):
    own = tmp_path / "own"
    _checkpoint(own, steps=1, run_id="old-run")
    with pytest.raises(RunMismatch, match="written by run 'old-run', not by this run 'new-run'"):
        newest_checkpoint(own, run_id="new-run")
    assert newest_checkpoint(own, run_id="old-run").step == 1
    a = servers("a", run_id="new-run")
    with pytest.raises(ReplicaError, match="HTTP 400 .*written by run 'old-run', not by this run 'new-run'"):
        push_replica(a.url, step_dir(own, 1), owner="rank-0", step=1, token=TOKEN)
    ft = FaultTolerance(FTConfig(str(tmp_path / "node"), "rank-0", ("rank-0",), ("n0",), f"file://{tmp_path / 's'}",
                                 "new-run", replicas=0, secret="5e" * 32))
    try:
        shutil.copytree(step_dir(own, 1), step_dir(ft.own, 1))
        with pytest.raises(RunMismatch, match=r"holds checkpoints of run 'old-run', not of this run 'new-run'"):
            ft.check_run()
    finally:
        ft.close()


def test_a_folder_named_for_one_step_holding_another_is_never_taken_for_it(tmp_path, caplog):
    own = tmp_path / "own"
    _checkpoint(own, steps=2)
    shutil.copytree(step_dir(own, 2), step_dir(own, 9))  # "step-9" holds step 2's state
    with caplog.at_level(logging.WARNING):
        assert newest_checkpoint(own, step=9) is None
        assert newest_checkpoint(own).step == 2  # the folder is skipped, the real newest taken
    assert "the state of step 2, expected step 9" in caplog.text


def _trickle(url: str, body: bytes, stop: threading.Event, *, token=TOKEN, interval=0.1) -> dict:
    """A PUT of ``body`` sent one byte per ``interval`` after its first 64 bytes, until ``stop`` or the server hangs
    up; what happened (``cut_after_s`` once the server closed the connection)."""
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)))
    s.sendall(f"PUT /v1/replicas/rank-9/1 HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
              f"Authorization: Bearer {token}\r\n\r\n".encode() + body[:64])
    t0, out = time.monotonic(), {}
    try:
        for i in range(64, len(body)):
            if stop.wait(interval):
                break
            s.sendall(body[i:i + 1])
    except OSError:  # the server shut the connection: the deadline
        out["cut_after_s"] = time.monotonic() - t0
    finally:
        s.close()
    return out


def test_a_slow_upload_holds_up_no_other_push_and_is_cut_off_at_its_deadline(tmp_path, servers):
    own, slow_own = tmp_path / "own", tmp_path / "slow"
    _checkpoint(own, owner="rank-1", steps=1)
    _checkpoint(slow_own, owner="rank-9", steps=1, width=256)
    body = _frame(step_dir(slow_own, 1))  # rank-9's upload, sent a byte at a time
    patient = servers("patient", timeout_s=600.0)  # the trickler is not cut off here: it holds its connection
    t0 = time.monotonic()
    push_replica(patient.url, step_dir(own, 1), owner="rank-1", step=1, token=TOKEN)
    alone = time.monotonic() - t0
    shutil.rmtree(step_dir(patient.root / "rank-1", 1))
    stop = threading.Event()
    slow = threading.Thread(target=_trickle, args=(patient.url, body, stop), daemon=True)
    slow.start()
    time.sleep(0.5)  # the trickler is inside its transfer
    done = threading.Event()
    threading.Thread(target=lambda: (push_replica(patient.url, step_dir(own, 1), owner="rank-1", step=1,
                                                  token=TOKEN), done.set()), daemon=True).start()
    try:
        assert done.wait(max(30.0, 50 * alone)), "a push waited for another peer's slow upload"
        assert slow.is_alive()  # ... which is still going
    finally:
        stop.set()
    assert list_steps(patient.root / "rank-1") == [1]

    strict = servers("strict", timeout_s=1.0, min_rate=1 << 30)  # a deadline of about 1 s for this transfer
    got = _trickle(strict.url, body, threading.Event())
    assert "cut_after_s" in got and got["cut_after_s"] < 1.0 + max(10.0, 20 * alone), got
    assert list_steps(strict.root / "rank-9") == [] and strict.refused == 1


def test_a_peer_trickling_a_replica_back_is_cut_off_at_the_deadline(tmp_path):
    """A holder that sends its reply one byte at a time -- each byte well within the per-read timeout -- fails the
    fetch once the transfer's deadline (timeout + bytes at the minimum rate) is up: a rebuild cannot hang on it."""
    srv = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve():
        c, _ = srv.accept()
        c.recv(65536)
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: 1000000\r\n\r\n"
                  + struct.pack("<Q", 500_000))  # a manifest of half a megabyte is on its way ...
        try:
            while not stop.wait(0.1):
                c.sendall(b" ")  # ... a byte at a time
        except OSError:
            pass
        c.close()

    threading.Thread(target=serve, daemon=True).start()
    url = f"http://127.0.0.1:{srv.getsockname()[1]}"
    t0 = time.monotonic()
    try:
        with pytest.raises(ReplicaError, match="deadline"):
            fetch_checkpoint(url, "rank-0", 1, timeout_s=1.0)  # deadline: 1 s + 1 MB at 8 MiB/s = 1.12 s
    finally:
        stop.set()
        srv.close()
    assert time.monotonic() - t0 < 1.2 + 15.0


HOLDER = r"""
import sys
from syncd.trainer.ft.replica_server import ReplicaServer
s = ReplicaServer(sys.argv[1], token=sys.argv[2], timeout_s=600)
print(s.url, flush=True)
sys.stdin.readline()
"""


def test_a_holder_killed_mid_transfer_leaves_no_partial_folder_once_it_starts_again(tmp_path):
    own, held = tmp_path / "own", tmp_path / "held"
    _checkpoint(own, owner="rank-9", steps=1, width=256)
    body = _frame(step_dir(own, 1))

    def holder():
        p = subprocess.Popen([sys.executable, "-c", HOLDER, str(held), TOKEN], cwd=ROOT, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
        return p, p.stdout.readline().strip()

    p, url = holder()
    stop = threading.Event()
    threading.Thread(target=_trickle, args=(url, body, stop), daemon=True).start()
    deadline = time.monotonic() + 120
    while not list((held / "rank-9").glob(".tmp-*")):  # the transfer is landing
        assert time.monotonic() < deadline and p.poll() is None
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    stop.set()
    assert list((held / "rank-9").glob(".tmp-*"))  # what a killed holder leaves
    p, url = holder()
    try:
        assert not list((held / "rank-9").glob(".tmp-*")) and list_steps(held / "rank-9") == []
    finally:
        p.stdin.close()
        p.wait(60)


def test_a_push_the_holder_refuses_for_its_length_never_reads_the_body(tmp_path, servers):
    """A request without a token is answered at once, before its (huge) body: nothing is read or written."""
    a = servers("a")
    conn = http.client.HTTPConnection(*a.url.removeprefix("http://").split(":"), timeout=30)
    conn.putrequest("PUT", "/v1/replicas/rank-0/1")
    conn.putheader("Content-Length", str(1 << 40))
    conn.endheaders()
    resp = conn.getresponse()
    assert resp.status == 401 and a.unauthorized == 1
    conn.close()
    assert not os.listdir(a.root)
