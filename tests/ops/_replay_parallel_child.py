"""One rank of the vocab-parallel kept_logprobs test (started by torch.multiprocessing with gloo on loopback)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def run(rank: int, world: int, init: str, case: dict, out_dir: str) -> None:
    from syncd.ops import replay

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        logits = case["logits"]
        V = logits.shape[1]
        per = V // world
        lo = rank * per
        local = logits[:, lo:lo + per].clone().requires_grad_()
        out = replay.kept_logprobs_vocab_parallel(local, case["ids"], case["offsets"], case["targets"], vocab_start=lo,
                                                  vocab_size=V, temperature=case["temperature"])
        (out * case["w"]).sum().backward()
        error = None
        try:
            bad = case["targets"].clone()
            bad[0] = (int(bad[0]) + 1) % V if case["ids"][0] != (int(bad[0]) + 1) % V else (int(bad[0]) + 2) % V
            replay.kept_logprobs_vocab_parallel(local, case["ids"], case["offsets"], bad, vocab_start=lo,
                                                vocab_size=V)
        except ValueError as exc:
            error = str(exc)
        torch.save({"out": out.detach(), "grad": local.grad, "error": error}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()
