"""ReplayRecorder with a spill directory: a chunk the store refuses is written to disk at once, retried on a timer
without a flush, and removed from disk once the store has it; a recorder killed before the store came back leaves
its chunks on disk, and the next recorder on that directory writes them. Nothing is lost."""

from __future__ import annotations

import time

import torch

from syncd.engine.replay import ReplayRecorder, read_request
from tests.engine._refusing_store import RefusingStore


def _add(rec, rid, n=3):
    for i in range(n):
        rec.add(rid, position=5 + i, index=i, version=2, token_id=i, logprob=-0.5, kept=torch.tensor([i, 40]))
    rec.finish(rid)


def _spilled(spill):
    return sorted(p for p in spill.rglob("*.srpl"))


def test_refused_chunks_are_spilled_retried_and_unspilled(tmp_path):
    store, spill = RefusingStore(tmp_path / "store"), tmp_path / "spill"
    rec = ReplayRecorder(store, "run", vocab_size=64, spill_dir=spill, retry_s=0.05)
    _add(rec, "a")
    deadline = time.monotonic() + 10
    while not _spilled(spill):
        assert time.monotonic() < deadline, "the refused chunk was not spilled"
        time.sleep(0.01)
    [path] = _spilled(spill)
    assert path.relative_to(spill).as_posix() in rec.spilled and not rec.written
    store.refuse = False  # the store comes back: the timer retries without a flush or another write
    while not rec.written:
        assert time.monotonic() < deadline, "the spilled chunk was not retried"
        time.sleep(0.01)
    assert not _spilled(spill) and not rec.spilled
    assert [r.token_id for c in read_request(store, "run", "a") for r in c.records] == [0, 1, 2]
    rec.close()


def test_a_later_recorder_writes_what_an_earlier_one_spilled(tmp_path):
    store, spill = RefusingStore(tmp_path / "store"), tmp_path / "spill"
    first = ReplayRecorder(store, "run", vocab_size=64, spill_dir=spill, retry_s=60)
    _add(first, "b")
    _add(first, "c", 2)
    deadline = time.monotonic() + 10
    while len(_spilled(spill)) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    # the process dies here (its queue is lost with it); the store comes back; a new recorder starts
    store.refuse = False
    second = ReplayRecorder(store, "run", vocab_size=64, spill_dir=spill)
    second.flush(10)
    assert len(second.written) == 2 and not _spilled(spill)
    assert [r.token_id for c in read_request(store, "run", "b") for r in c.records] == [0, 1, 2]
    assert [r.index for c in read_request(store, "run", "c") for r in c.records] == [0, 1]
    second.close()
