"""``syncd.trainer.ft.prefetch`` and what a restore does with it, on a real disk and real replica servers: the newest
two checkpoints read ahead are what a restore uses while each one's manifest is still the one on disk (a step written
again is read again), a corrupt folder is refused as a restore refuses it and is not read again every poll, the
reading thread runs at the lowest CPU priority; and a restore's re-offer to the holders sends nothing to a holder that
lists exactly that checkpoint, but sends it to one that lost it."""

from __future__ import annotations

import os
import shutil
import time

import torch

from syncd.procs import wait_until
from syncd.trainer.ft.checkpoint import step_dir
from syncd.trainer.ft.fault_tolerance import FaultTolerance, FTConfig, own_dir
from syncd.trainer.ft.prefetch import CheckpointPrefetch

SECRET = "5e" * 32


def _ft(root, owner="rank-0", owners=("rank-0",), nodes=("n0",), store=None, replicas=0):
    return FaultTolerance(FTConfig(str(root), owner, owners, nodes, store or f"file://{root}-store", "run",
                                   replicas=replicas, keep=3, on_busy="wait", gate_timeout_s=30, secret=SECRET))


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Linear(16, 4)


def test_a_checkpoint_read_ahead_is_used_while_current_and_a_step_written_again_is_read_again(tmp_path):
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    ft = _ft(tmp_path / "n0")
    try:
        m1, m2 = _model(1), _model(2)
        ft.checkpointer.save(1, m1, None, state={"step": 1}, wait=True)
        ft.checkpointer.save(2, m2, None, state={"step": 2}, wait=True)
        assert ft.checkpointer.flush(30)
        pre = CheckpointPrefetch(own_dir(tmp_path / "n0", "rank-0"), owner="rank-0", run_id="run", poll_s=0.02)
        pre.start()
        wait_until(lambda: pre.reads >= 1, 30, "the first read ahead")
        assert os.getpriority(os.PRIO_PROCESS, pre._thread.native_id) == 19  # this thread only
        assert os.getpriority(os.PRIO_PROCESS, 0) == nice  # the caller's thread keeps its own
        m3 = _model(3)  # the next step lands: kept with the one before (the ranks may agree on either)
        ft.checkpointer.save(3, m3, None, state={"step": 3}, wait=True)
        assert ft.checkpointer.flush(30)
        wait_until(lambda: pre.reads >= 2, 30, "the second read ahead")
        got = pre.stop()
        assert [p.step for p in got] == [3, 2] and torch.equal(got[1].checkpoint.model["weight"], m2.weight)
        # the disk copy rots after it was read: the restore uses the copy verified when read ahead
        body = step_dir(ft.own, 2) / "model.safetensors"
        raw = bytearray(body.read_bytes())
        raw[-5] ^= 0x01
        body.write_bytes(bytes(raw))
        ft.preloaded = got
        assert ft.load(2) is got[1].checkpoint and ft.load(3) is got[0].checkpoint
        assert ft.load(1).step == 1  # another step: read from disk
        ft.adopt(ft.load(2))
        assert ft.preloaded == []  # dropped once adopted
    finally:
        ft.close()

    # the job went back to step 1 and wrote another step 2: a copy read ahead of the old one is not used
    ft = _ft(tmp_path / "n0")
    try:
        ft.adopt(ft.load(1))
        m4 = _model(4)
        ft.checkpointer.save(2, m4, None, state={"step": 2}, wait=True)
        assert ft.checkpointer.flush(30)
        ft.preloaded = got
        c = ft.load(2)
        assert c is not got[1].checkpoint and torch.equal(c.model["weight"], m4.weight)
    finally:
        ft.close()


def test_a_corrupt_checkpoint_is_refused_once_and_the_next_is_read(tmp_path, caplog):
    ft = _ft(tmp_path / "n0")
    try:
        ft.checkpointer.save(1, _model(1), None, state={"step": 1}, wait=True)
        assert ft.checkpointer.flush(30)
        body = step_dir(ft.own, 1) / "model.safetensors"
        raw = bytearray(body.read_bytes())
        raw[-5] ^= 0x01
        body.write_bytes(bytes(raw))
        pre = CheckpointPrefetch(ft.own, owner="rank-0", run_id="run", poll_s=0.02).start()
        wait_until(lambda: pre.failures >= 1, 30, "the corrupt folder refused")
        time.sleep(0.3)  # about 15 more polls
        assert pre.failures == 1 and pre.reads == 0  # refused as a restore refuses it, and not read again
        assert "does not match its SHA-256" in caplog.text
        m2 = _model(2)
        ft.checkpointer.save(2, m2, None, state={"step": 2}, wait=True)
        wait_until(lambda: pre.reads >= 1, 30, "the next checkpoint read ahead")
        got = pre.stop()
        assert [p.step for p in got] == [2] and torch.equal(got[0].checkpoint.model["bias"], m2.bias)
    finally:
        ft.close()


def test_a_restore_re_offers_its_step_only_to_a_holder_that_lacks_it(tmp_path):
    store = f"file://{tmp_path / 'store'}"
    owners, nodes = ("rank-0", "rank-1"), ("n0", "n1")
    fts = [_ft(tmp_path / n, o, owners, nodes, store, replicas=1) for o, n in zip(owners, nodes)]
    try:
        fts[0].checkpointer.save(1, _model(1), None, state={"step": 1}, wait=True)
        assert fts[0].durable(1)
        held = step_dir(tmp_path / "n1" / "rank-1" / "held" / "rank-0", 1)
        first = held.stat().st_ino
        fts[0].close()  # rank 0 restarts on the same node, its disk kept
        fts[0] = _ft(tmp_path / "n0", "rank-0", owners, nodes, store, replicas=1)
        fts[0].adopt(fts[0].load(1))
        assert fts[0].durable(1)  # counted: the holder lists exactly this checkpoint
        assert held.stat().st_ino == first  # and it was not sent again

        shutil.rmtree(held)  # the holder lost it
        fts[0].close()
        fts[0] = _ft(tmp_path / "n0", "rank-0", owners, nodes, store, replicas=1)
        fts[0].adopt(fts[0].load(1))
        assert fts[0].durable(1) and held.is_dir()  # sent again
    finally:
        for ft in fts:
            ft.close()
