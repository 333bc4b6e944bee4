"""``kept_logprobs_vocab_parallel`` on two real processes (gloo on loopback), each holding half of the vocabulary:
the result on both ranks and the concatenated gradient equal the single-process ``kept_logprobs``."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from syncd.ops import replay
from tests.ops._replay_parallel_child import run
from tests.ops.test_replay_kept import make_case

pytestmark = pytest.mark.integration


def test_two_gloo_ranks_reproduce_the_single_process_op(tmp_path):
    logits, ids, offsets, targets = make_case(24, 64, seed=11, max_kept=20)
    case = {"logits": logits, "ids": ids, "offsets": offsets, "targets": targets, "temperature": 0.8,
            "w": torch.randn(24, generator=torch.Generator().manual_seed(3))}
    init = f"file://{tmp_path}/rendezvous"
    mp.start_processes(run, args=(2, init, case, str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    x = logits.clone().requires_grad_()
    want = replay.kept_logprobs(x, ids, offsets, targets, 0.8)
    (want * case["w"]).sum().backward()
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    torch.testing.assert_close(r0["out"], want.detach(), atol=2e-6, rtol=0)
    assert torch.equal(r0["out"], r1["out"])
    torch.testing.assert_close(torch.cat([r0["grad"], r1["grad"]], dim=1), x.grad, atol=2e-6, rtol=0)
    assert r0["error"] and "not in its kept set" in r0["error"] and r0["error"] == r1["error"]
