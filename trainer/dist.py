"""Data parallelism and determinism for the thin trainer, over ``torch.distributed``.

:class:`DataParallel` joins the process group named by the usual variables (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``, as ``torchrun`` or ``syncd.trainer.run --nproc`` set them): gloo on the CPU, NCCL
on CUDA. One process (``WORLD_SIZE`` unset or 1) needs no process group. Every rank holds the whole model and
takes the same optimizer steps; :meth:`DataParallel.all_reduce_grads` sums the gradients in a fixed order: one
flat buffer in the model's parameter order (its layout never changes), one all-reduce, copied back. Losses are
normalised by the step's global token count, so the sum is the gradient of the whole step.

The step loop (:func:`syncd.trainer.rl.loop.train`) drives it as it drives the elastic
:class:`syncd.trainer.ft.elastic.ElasticDP`: :meth:`DataParallel.begin_step` gives this rank's share of the next step,
:meth:`DataParallel.commit` is always True here (a rank that fails stops the whole job: the others' collectives
fail), and :attr:`DataParallel.step` counts the committed steps.

:func:`make_deterministic` is what makes two runs from the same seed on the same rollouts end with
bit-identical weights: ``torch.use_deterministic_algorithms(True)``, a fixed number of intra-op threads, seeded
generators, and no filling of uninitialised memory (the trainer never reads it; filling costs time).

Thread-safety: collectives are issued from the training thread only.
"""

from __future__ import annotations

import datetime
import importlib
import logging
import os
import random

import torch

log = logging.getLogger(__name__)

__all__ = ["DataParallel", "make_deterministic", "weights_digest"]


def make_deterministic(seed: int, threads: int = 1) -> None:
    """Deterministic algorithms, ``threads`` intra-op threads, every generator seeded with ``seed``."""
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.set_num_threads(threads)
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % (1 << 32))
    except ImportError:  # pragma: no cover
        pass
    if torch.cuda.is_available():
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False


def weights_digest(model: torch.nn.Module) -> str:
    """SHA-256 (hex) over every parameter and buffer's name, dtype, shape and bytes, in state-dict order."""
    import hashlib

    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def flat_grads(params) -> torch.Tensor:
    """Every parameter's gradient in one float32 buffer, in parameter order (a missing one as zeros): the fixed
    reduction layout both data-parallel engines (``DataParallel``, ``syncd.trainer.ft.elastic.ElasticDP``) sum."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in params])


def set_grads(params, flat: torch.Tensor) -> None:
    """Write a :func:`flat_grads` buffer back into the parameters' gradients."""
    at = 0
    for p in params:
        n = p.numel()
        g = flat[at:at + n].view_as(p).to(p.dtype)
        if p.grad is None:
            p.grad = g.clone()
        else:
            p.grad.copy_(g)
        at += n


class DataParallel:
    """The trainer's process group (see the module docstring). ``device``: where this rank computes."""

    #: a plain job never heals a rank from a peer's live state: it restarts as a whole, from checkpoints
    healed = False

    def __init__(self, *, device: str | torch.device | None = None, timeout_s: float = 900.0):
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        if not 0 <= self.rank < self.world:
            raise ValueError(f"RANK={self.rank} is not in [0, WORLD_SIZE={self.world})")
        if device is None:
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', self.rank))}" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.group = None
        self.step = 0  # steps committed (the next one is step + 1)
        if self.world > 1:
            import torch.distributed as dist

            # Importing torch._inductor after init_process_group (torch.use_deterministic_algorithms imports it)
            # leaves references to the default group that destroy_process_group does not drop: gloo's threads
            # then live into interpreter exit, where a rank can abort ("terminate called without an active
            # exception"). Imported first, the group is freed by close().
            importlib.import_module("torch._inductor.config")
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            dist.init_process_group(backend, rank=self.rank, world_size=self.world,
                                    timeout=datetime.timedelta(seconds=timeout_s))
            self.group = dist.group.WORLD
            log.info("rank %d of %d joined the %s process group", self.rank, self.world, backend)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def set_step(self, step: int) -> None:
        """The step the ranks' restored state belongs to (before the first :meth:`begin_step`)."""
        self.step = int(step)

    def begin_step(self) -> tuple[int, int]:
        """``(rank, world)``: this rank's share of step ``step + 1`` (every rank takes part in every step)."""
        return self.rank, self.world

    def commit(self) -> bool:
        """Count step ``step + 1`` committed; always True (call after :meth:`all_reduce_grads`, before the
        optimizer steps)."""
        self.step += 1
        return True

    def broadcast_result(self, make):
        """``make()`` run on rank 0 (pass None on the other ranks), its result on every rank. An exception there
        is raised there and, as a RuntimeError, on the other ranks (which would otherwise wait for rank 0 forever)."""
        if self.is_main:
            try:
                value = {"ok": make()}
            except Exception as exc:  # noqa: BLE001 -- the other ranks must hear of it
                self.broadcast({"error": f"{type(exc).__name__}: {exc}"})
                raise
            return self.broadcast(value)["ok"]
        value = self.broadcast(None)
        if "error" in value:
            raise RuntimeError(f"rank 0 stopped the run: {value['error']}")
        return value["ok"]

    def summary(self, model: torch.nn.Module) -> dict:
        """What the ranks report at the end of a run: ``digest`` (:func:`weights_digest` of rank 0's weights) and
        ``ranks_agree`` (every rank ended with the same weights); both None off rank 0. A collective."""
        digests = self.gather(weights_digest(model))
        return {"digest": digests[0] if digests else None,
                "ranks_agree": None if digests is None else len(set(digests)) == 1}

    def broadcast(self, obj):
        """``obj`` of rank 0 on every rank (pickled: the ranks trust each other)."""
        if self.world == 1:
            return obj
        import torch.distributed as dist

        box = [obj if self.is_main else None]
        dist.broadcast_object_list(box, src=0, device=self.device if self.device.type == "cuda" else None)
        return box[0]

    def gather(self, obj) -> list | None:
        """Every rank's ``obj``, in rank order, on rank 0 (None elsewhere)."""
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world if self.is_main else None
        dist.gather_object(obj, out, dst=0)
        return out

    def all_reduce_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Sum every parameter's gradient over the ranks (a missing gradient counts as zeros), in place."""
        if self.world == 1:
            return
        import torch.distributed as dist

        flat = flat_grads(params)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        set_grads(params, flat)

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """Sum of a few numbers over the ranks (float64)."""
        if self.world == 1:
            return list(values)
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.cpu().tolist()

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def close(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
            self.group = None  # the last reference: gloo's threads are joined here, not at interpreter exit
