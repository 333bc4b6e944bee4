"""Optimizers of the thin trainer: AdamW, or ``torch.optim.Muon`` for the hidden 2-D matrices with AdamW for the
rest (Moonlight's recipe).

``muon``: every 2-D parameter except the token embeddings and the output head (which Moonlight, like Keller
Jordan's original, leaves to AdamW; both are 2-D and Muon would accept them) goes to Muon with
``adjust_lr_fn="match_rms_adamw"``: its orthogonalised update is scaled by ``0.2 * sqrt(max(A, B))``, so its RMS
is about ``0.2 * lr`` whatever the matrix's shape, the RMS of a typical AdamW update, and both halves share one
learning rate and weight decay. Norm weights, biases, embeddings and the head go to AdamW. Muon's
Newton-Schulz iteration runs in bfloat16 and is deterministic on the CPU (torch 2.13).

:class:`Optimizers` steps and zeroes both as one and lists which parameter went where
(:attr:`Optimizers.groups`).
"""

from __future__ import annotations

import torch

__all__ = ["OPTIMIZERS", "Optimizers", "build_optimizer", "muon_split"]

OPTIMIZERS = ("adamw", "muon")


def muon_split(model: torch.nn.Module) -> tuple[list[str], list[str]]:
    """``(names for Muon, names for AdamW)`` of ``model``'s trainable parameters (see the module docstring)."""
    skip = set()
    for m in model.modules():
        if isinstance(m, torch.nn.Embedding):
            skip |= {id(p) for p in m.parameters(recurse=False)}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None:
        skip |= {id(p) for p in head.parameters(recurse=False)}
    muon, adamw = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (muon if p.ndim == 2 and id(p) not in skip else adamw).append(name)
    return muon, adamw


class Optimizers:
    """One or two torch optimizers used as one. ``groups``: optimizer name -> parameter names."""

    def __init__(self, optimizers: list[torch.optim.Optimizer], groups: dict[str, list[str]]):
        self.optimizers, self.groups = optimizers, groups

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=True)

    def state_dict(self) -> list[dict]:
        return [o.state_dict() for o in self.optimizers]

    def load_state_dict(self, states: list[dict]) -> None:
        if len(states) != len(self.optimizers):
            raise ValueError(f"{len(states)} optimizer states for {len(self.optimizers)} optimizers")
        for o, s in zip(self.optimizers, states):
            o.load_state_dict(s)


def build_optimizer(model: torch.nn.Module, name: str = "adamw", *, lr: float = 1e-3, weight_decay: float = 0.0,
                    betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                    muon_momentum: float = 0.95) -> Optimizers:
    """The optimizer ``name`` (one of :data:`OPTIMIZERS`) over ``model``'s trainable parameters. AdamW runs
    with ``foreach=False`` (one code path, parameter by parameter, on every device). ValueError for an unknown
    name or bad hyperparameters."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
    if not lr > 0 or weight_decay < 0:
        raise ValueError(f"need lr > 0 and weight_decay >= 0, got lr={lr}, weight_decay={weight_decay}")
    params = dict(model.named_parameters())
    adam_kw = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)
    if name == "adamw":
        names = [n for n, p in params.items() if p.requires_grad]
        return Optimizers([torch.optim.AdamW([params[n] for n in names], **adam_kw)], {"adamw": names})
    muon_names, adam_names = muon_split(model)
    opts = [torch.optim.Muon([params[n] for n in muon_names], lr=lr, weight_decay=weight_decay,
                             momentum=muon_momentum, adjust_lr_fn="match_rms_adamw")]
    if adam_names:
        opts.append(torch.optim.AdamW([params[n] for n in adam_names], **adam_kw))
    return Optimizers(opts, {"muon": muon_names, "adamw": adam_names})
