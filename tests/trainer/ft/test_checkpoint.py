"""``syncd.trainer.ft.checkpoint``: per-step asynchronous checkpoints on a real disk -- a restored run continues bit for
bit (AdamW and Muon, RNG included), the snapshot holds the step boundary even though the weights change right after,
the files are standard safetensors, torn and corrupt checkpoints are skipped with the reason and nothing half
loaded, retention is bounded, a forged manifest is refused under a key, and a writer killed with SIGKILL in the
middle of writing never leaves a checkpoint that loads torn."""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from syncd.trainer.ft.checkpoint import Checkpointer, agreed_step, agreement, list_steps, newest_checkpoint, step_dir
from syncd.trainer.optim import build_optimizer

ROOT = Path(__file__).resolve().parents[3]


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.drop = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4), torch.nn.Dropout(0.3)

    def forward(self, x):
        return self.b(self.drop(torch.relu(self.a(x))))


def _train(model, opt, steps, x, ckpt=None, start=0):
    for s in range(start + 1, start + steps + 1):
        model(x).pow(2).mean().backward()  # dropout draws from torch's RNG: restored with the checkpoint
        if ckpt is not None:
            ckpt.before_update()
        opt.step()
        opt.zero_grad()
        if ckpt is not None:
            ckpt.save(s, model, opt, state={"step": s, "cursor": [s, 2 * s], "lr": 0.1})


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_restored_run_continues_bit_for_bit(tmp_path, optimizer):
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    ref = Net()
    ref_opt = build_optimizer(ref, optimizer, lr=1e-2)
    _train(ref, ref_opt, 6, x)

    torch.manual_seed(0)
    run = Net()
    opt = build_optimizer(run, optimizer, lr=1e-2)
    ck = Checkpointer(tmp_path / "ck", owner="rank-0", keep=2, on_busy="wait")
    _train(run, opt, 3, x, ck)
    ck.close()
    torch.manual_seed(12345)  # a new process would start elsewhere; the checkpoint's RNG state must win
    fresh = Net()
    fresh_opt = build_optimizer(fresh, optimizer, lr=1e-2)
    c = newest_checkpoint(tmp_path / "ck", owner="rank-0")
    assert c.step == 3 and c.state == {"step": 3, "cursor": [3, 6], "lr": 0.1}
    c.apply(fresh, fresh_opt)
    assert _same(fresh, run)
    _train(fresh, fresh_opt, 3, x, start=3)
    assert _same(fresh, ref)  # no extra or missing optimizer step, the same dropout masks
    state = fresh_opt.state_dict()[-1]["state"]
    assert {int(v["step"]) for v in state.values()} == {6}


def test_the_snapshot_holds_the_step_boundary(tmp_path):
    torch.manual_seed(0)
    m = torch.nn.Linear(256, 256)
    opt = torch.optim.AdamW(m.parameters(), lr=0.5, foreach=False)
    m(torch.randn(4, 256)).sum().backward()
    opt.step()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    ck = Checkpointer(tmp_path / "ck", owner="rank-0")
    ck.save(1, m, opt)
    ck.before_update()  # the next optimizer step may now change the weights in place
    m(torch.randn(4, 256)).sum().backward()
    opt.step()
    ck.close()
    assert not torch.equal(m.weight, before["weight"])
    c = newest_checkpoint(tmp_path / "ck")
    assert all(torch.equal(c.model[k], before[k]) for k in before)
    assert ck.stats.saved == 1 and ck.stats.stall_s >= 0


def test_files_are_standard_safetensors(tmp_path):
    from safetensors import safe_open

    torch.manual_seed(0)
    m = Net()
    ck = Checkpointer(tmp_path / "ck", owner="rank-3")
    ck.save(7, m, None, state=None)
    ck.close()
    with safe_open(str(step_dir(tmp_path / "ck", 7) / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(m.state_dict())
        assert all(torch.equal(f.get_tensor(k), v) for k, v in m.state_dict().items())
        assert f.metadata()["syncd_step"] == "7"


def _three_checkpoints(root):
    torch.manual_seed(0)
    m = Net()
    opt = torch.optim.AdamW(m.parameters(), lr=0.1, foreach=False)
    ck = Checkpointer(root, owner="rank-0", keep=3, on_busy="wait")
    _train(m, opt, 3, torch.randn(4, 8), ck)
    ck.close()
    return m


def test_torn_and_corrupt_checkpoints_are_skipped_with_the_reason(tmp_path, caplog):
    root = tmp_path / "ck"
    _three_checkpoints(root)
    (step_dir(root, 3) / "MANIFEST.json").unlink()  # torn: the write never got to the manifest
    data = bytearray((step_dir(root, 2) / "optim.safetensors").read_bytes())
    data[len(data) // 2] ^= 0x40  # one bit flipped on disk
    (step_dir(root, 2) / "optim.safetensors").write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, "syncd.trainer.ft.checkpoint"):
        c = newest_checkpoint(root, owner="rank-0")
    assert c.step == 1
    assert "optim.safetensors does not match its SHA-256 in the manifest (corrupt)" in caplog.text
    assert list_steps(root) == [2, 1]  # step 3 has no manifest: not even a candidate
    model = (step_dir(root, 1) / "model.safetensors")
    model.write_bytes(model.read_bytes()[:-5])
    with caplog.at_level(logging.WARNING, "syncd.trainer.ft.checkpoint"):
        assert newest_checkpoint(root, owner="rank-0") is None  # nothing loads half a state
    assert "model.safetensors holds" in caplog.text and "(torn)" in caplog.text


def test_a_forged_manifest_is_refused_under_a_key(tmp_path, caplog, monkeypatch):
    monkeypatch.setenv("SYNCD_SIGNING_KEY", "k" * 32)
    root = tmp_path / "ck"
    _three_checkpoints(root)
    assert newest_checkpoint(root).step == 3
    raw = (step_dir(root, 3) / "MANIFEST.json").read_text()
    (step_dir(root, 3) / "MANIFEST.json").write_text(raw.replace('"step": 3', '"step": 3 '))
    p = step_dir(root, 2) / "MANIFEST.json"
    p.write_text(p.read_text().replace('"owner": "rank-0"', '"owner": "rank-9"'))
    with caplog.at_level(logging.WARNING, "syncd.trainer.ft.checkpoint"):
        assert newest_checkpoint(root).step == 3  # whitespace is not a forgery: the signature covers content
        assert newest_checkpoint(root, at_most=2).step == 1
    assert "signature does not verify" in caplog.text
    monkeypatch.setenv("SYNCD_SIGNING_KEY", "another key of 32 bytes, or more")
    assert newest_checkpoint(root) is None


def test_retention_leftovers_and_skipping(tmp_path):
    root = tmp_path / "ck"
    (root / ".tmp-step-000000000009-1-2").mkdir(parents=True)  # a crashed write
    torch.manual_seed(0)
    m = Net()
    opt = torch.optim.AdamW(m.parameters(), lr=0.1, foreach=False)
    ck = Checkpointer(root, owner="rank-0", keep=2, on_busy="wait")
    assert not any(p.name.startswith(".tmp-") for p in root.iterdir())
    _train(m, opt, 5, torch.randn(4, 8), ck)
    ck.flush()
    assert list_steps(root) == [5, 4]
    ck.on_busy = "skip"
    ck._idle.clear()  # pretend the previous checkpoint is still being written
    assert ck.save(6, m, opt) is False and ck.stats.skipped == 1
    ck._idle.set()
    assert ck.save(6, m, opt, wait=True) is True
    ck.close()
    assert list_steps(root) == [6, 5] and ck.durable_step == 6


def test_the_callers_decision_overrides_on_busy_and_wait_is_the_default(tmp_path):
    """Ranks decide together (``skip=<any rank busy>``): an idle rank skips when told to, a busy one in skip mode
    waits when told not to skip; the default waits for a write in flight and so checkpoints every step."""
    torch.manual_seed(0)
    m = Net()
    opt = torch.optim.AdamW(m.parameters(), lr=0.1, foreach=False)
    ck = Checkpointer(tmp_path / "ck", owner="rank-0", keep=3)
    assert ck.on_busy == "wait"
    _train(m, opt, 3, torch.randn(4, 8), ck)  # a save per step, each waiting for the previous write if need be
    ck.flush()
    assert list_steps(tmp_path / "ck") == [3, 2, 1] and ck.stats.skipped == 0 and not ck.busy
    assert ck.save(4, m, opt, skip=True) is False and ck.stats.skipped == 1  # idle, but another rank is busy
    ck.on_busy = "skip"
    assert ck.save(4, m, opt) is True  # idle: its own on_busy does not skip
    assert ck.save(5, m, opt, skip=False) is True  # busy or not, every rank was idle when they decided: it waits
    ck.wait_previous()  # what the loop calls before it reports a step: the previous checkpoint is then on disk
    assert not ck.busy and ck.durable_step == 5 and list_steps(tmp_path / "ck")[0] == 5
    ck.close()
    assert list_steps(tmp_path / "ck") == [5, 4, 3] and ck.stats.skipped == 1


def test_agreed_step_only_when_every_rank_wrote_the_same_step():
    def sums(*parts):
        return [sum(col) for col in zip(*parts)]

    class Ck:  # a checkpointer's newest finished write, as the agreement reads it
        def __init__(self, last):
            self.last_attempt = last

    ok9, ok11, failed9 = (agreement(Ck(x)) for x in ((9, True), (11, True), (9, False)))
    assert agreed_step(sums(ok9, ok9), 2) == 9 and agreed_step(ok9, 1) == 9
    assert agreed_step(sums(ok9, ok11), 2) is None  # different steps (their mean, 10, is no one's)
    assert agreed_step(sums(ok9, failed9), 2) is None and agreed_step(sums(ok9, agreement(None)), 2) is None
    assert agreed_step(sums(agreement(Ck(None)), ok9), 2) is None


def test_a_rank_whose_writes_fail_keeps_a_step_in_common_with_the_others(tmp_path):
    """Two ranks checkpoint every step (``keep=2``) and agree, with each step's all-reduce, on the newest step
    both hold. Rank 1's writes fail for real for three steps (its folder is replaced by a file): each failed write
    is retried until a newer step replaces it, and training is never held up by it; rank 0 keeps the agreed step
    next to its newest two, so a restart still finds a step both ranks hold. Once the folder is back, rank 1's
    pending write of the last step lands on its own retry; a newer step is agreed and the old ones go."""
    torch.manual_seed(0)
    m = Net()
    opt = torch.optim.AdamW(m.parameters(), lr=0.1, foreach=False)
    x = torch.randn(4, 8)
    roots = [tmp_path / "rank-0", tmp_path / "rank-1"]
    cks = [Checkpointer(r, owner=f"rank-{i}", keep=2, on_busy="wait") for i, r in enumerate(roots)]
    aside = tmp_path / "rank-1.aside"

    def step(s):
        m(x).pow(2).mean().backward()
        for ck in cks:
            ck.before_update()
        opt.step()
        opt.zero_grad()
        for ck in cks:
            ck.wait_previous()
        sums = [sum(col) for col in zip(*(agreement(ck) for ck in cks))]  # what the loss all-reduce carries
        common = agreed_step(sums, 2)
        if common is not None:
            for ck in cks:
                ck.agree(common)
        for ck in cks:
            ck.save(s, m, opt, state={"step": s})

    for s in range(1, 5):
        step(s)
    cks[1].flush()
    roots[1].rename(aside)
    roots[1].write_text("not a folder")  # rank 1's next writes fail (NotADirectoryError), as a broken disk's would
    for s in range(5, 8):
        step(s)
    for ck in cks:
        ck.flush(room_timeout=0)  # rank 1's write of step 7 is still being retried: not waited for
    assert cks[1].retrying and cks[1].last_attempt == (7, False) and cks[0].common_step == 4
    assert cks[1].stats.failures >= 3 and cks[1].stats.abandoned == 2  # steps 5 and 6: replaced by a newer one
    assert list_steps(aside) == [4, 3] and list_steps(roots[0]) == [7, 6, 4]
    assert max(set(list_steps(roots[0])) & set(list_steps(aside))) == 4
    roots[1].unlink()
    aside.rename(roots[1])
    assert cks[1].flush(timeout=60)  # the retry lands once the folder is back
    assert cks[1].stats.retried == 1 and cks[1].last_attempt == (7, True) and list_steps(roots[1]) == [7, 4]
    for s in range(8, 11):
        step(s)
    for ck in cks:
        ck.close()
    assert cks[0].common_step == 9 and list_steps(roots[0]) == list_steps(roots[1]) == [10, 9]


WRITER = r"""
import sys, torch
from syncd.trainer.ft.checkpoint import Checkpointer
ck = Checkpointer(sys.argv[1], owner="rank-0", keep=2, on_busy="wait")
torch.manual_seed(0)
state = {"w": torch.randn(4 << 20)}                    # 16 MB per checkpoint: a write takes a while
step = 0
while True:
    step += 1
    ck.before_update()                                  # the snapshot of the previous step holds its tensors
    state["w"].fill_(float(step))                       # the "optimizer step"
    ck.save(step, state, None, state={"step": step})
    print(step, flush=True)
"""


@pytest.mark.integration
def test_kill_9_while_writing_never_leaves_a_torn_checkpoint_to_load(tmp_path):
    root = tmp_path / "ck"
    rng = random.Random(7)
    for _ in range(3):
        p = subprocess.Popen([sys.executable, "-c", WRITER, str(root)], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
        while int(p.stdout.readline()) < 2:  # save(2) returned: it waited for step 1's write (on_busy="wait")
            pass
        time.sleep(rng.uniform(0.05, 0.6))  # then killed at a random point of a later write
        p.send_signal(signal.SIGKILL)
        p.wait()
        c = newest_checkpoint(root, owner="rank-0")
        assert c is not None, "a written checkpoint was lost"
        w = c.model["w"]
        assert c.state == {"step": c.step} and bool((w == float(c.step)).all()), "a torn or mixed checkpoint loaded"
    assert newest_checkpoint(root) is not None


def test_a_step_that_replaces_a_failed_write_is_snapshotted_before_the_weights_change(tmp_path):
    """A write that failed is retried until a newer step replaces it; that newer step's snapshot must still hold
    its own step boundary: ``before_update`` waits for it, however the failed one ended."""
    root = tmp_path / "ckpt"
    ck = Checkpointer(root, owner="rank-0", keep=1, on_busy="wait")
    w = {"w": torch.zeros(16 << 20)}  # 64 MB: the snapshot takes a while
    root.rename(tmp_path / "aside")
    root.write_text("not a folder")  # every write fails, for real
    ck.save(1, w, None, rng=False)
    deadline = time.monotonic() + 60
    while not ck.retrying:
        assert time.monotonic() < deadline, "the failed write is not being retried"
        time.sleep(0.01)
    w["w"].fill_(2.0)
    ck.save(2, w, None, rng=False)  # replaces step 1's retry
    ck.before_update()
    w["w"].fill_(3.0)  # the optimizer step right after
    root.unlink()
    (tmp_path / "aside").rename(root)
    assert ck.flush(timeout=60)
    ck.close()
    c = newest_checkpoint(root, owner="rank-0")
    assert c.step == 2 and bool((c.model["w"] == 2.0).all())
    assert ck.stats.abandoned == 1 and ck.stats.retried == 1
