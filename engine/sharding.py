"""How a tensor-parallel engine rank lays out a Llama/Qwen2-style dense model: fused and sliced ParamSpecs.

The layout is vLLM's (Megatron-style):

==========================================  ===============================  ==================================
local parameter (per rank ``r`` of ``W``)   made of (trainer tensors)        cut
==========================================  ===============================  ==================================
``...self_attn.qkv_proj.weight`` / bias     ``q_proj``, ``k_proj``, ``v_proj`` rows ``[r·n/W, (r+1)·n/W)`` of each,
                                                                             fused in q, k, v order (dim 0)
``...self_attn.o_proj.weight``              ``o_proj``                       columns (dim 1), row-parallel
``...mlp.gate_up_proj.weight``              ``gate_proj``, ``up_proj``       rows of each, fused (dim 0)
``...mlp.down_proj.weight``                 ``down_proj``                    columns (dim 1)
``model.embed_tokens.weight``               same                             vocabulary rows (dim 0)
``lm_head.weight``                          same                             vocabulary rows (dim 0)
norms                                       same                             replicated (1:1)
==========================================  ===============================  ==================================

Every dimension cut must divide by ``W`` (heads, kv heads, intermediate size, vocabulary); otherwise
``ValueError`` says which. Pure functions; thread-safe.
"""

from __future__ import annotations

import re
from typing import Mapping

import torch

from syncd.engines.params import ParamPiece, ParamSpec

__all__ = ["tp_specs", "fused_specs"]

_ATTN = re.compile(r"^(?P<pre>.*\.self_attn)\.(?P<which>[qkv])_proj\.(?P<kind>weight|bias)$")
_MLP = re.compile(r"^(?P<pre>.*\.mlp)\.(?P<which>gate|up)_proj\.weight$")
_ROW_PARALLEL = re.compile(r"^.*\.(self_attn\.o_proj|mlp\.down_proj)\.weight$")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def _shape(t) -> tuple[tuple[int, ...], torch.dtype]:
    if isinstance(t, torch.Tensor):
        return tuple(t.shape), t.dtype
    shape, dtype = t
    return tuple(shape), dtype


def _cut(n: int, world: int, what: str) -> int:
    if n % world:
        raise ValueError(f"{what} ({n}) does not divide into {world} tensor-parallel ranks")
    return n // world


def tp_specs(trainer: Mapping[str, object], *, rank: int, world_size: int, device: str = "cpu",
             num_heads: int, num_kv_heads: int) -> list[ParamSpec]:
    """The ParamSpecs of tensor-parallel rank ``rank`` of ``world_size`` for a dense Llama/Qwen2 model whose
    trainer tensors are ``trainer`` (name -> tensor, or -> ``(shape, dtype)``), in the module's layout.
    ``world_size=1`` gives the fused single-rank layout. Tensors outside the layout (biases of o_proj,
    unknown names) raise ``ValueError``."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside 0..{world_size - 1}")
    W, r = world_size, rank
    shapes = {k: _shape(v) for k, v in trainer.items()}
    specs: list[ParamSpec] = []
    done: set[str] = set()
    for name, (shape, dtype) in shapes.items():
        if name in done:
            continue
        m = _ATTN.match(name)
        if m:
            pre, kind = m["pre"], m["kind"]
            srcs = [f"{pre}.{w}_proj.{kind}" for w in "qkv"]
            heads = [num_heads, num_kv_heads, num_kv_heads]
            pieces, at = [], 0
            for src, h in zip(srcs, heads):
                if src not in shapes:
                    raise ValueError(f"{name!r} needs {src!r}, which the trainer does not have")
                s, dt = shapes[src]
                _cut(h, W, f"heads of {src}")
                n = _cut(s[0], W, f"rows of {src}")
                pieces.append(ParamPiece(src, s, 0, r * n, (r + 1) * n, at))
                at += n
                done.add(src)
            local = (at,) + shape[1:]
            specs.append(ParamSpec(f"{pre}.qkv_proj.{kind}", dtype, local, device, tuple(pieces)))
            continue
        m = _MLP.match(name)
        if m:
            pre = m["pre"]
            pieces, at = [], 0
            for src in (f"{pre}.gate_proj.weight", f"{pre}.up_proj.weight"):
                if src not in shapes:
                    raise ValueError(f"{name!r} needs {src!r}, which the trainer does not have")
                s, _ = shapes[src]
                n = _cut(s[0], W, f"rows of {src}")
                pieces.append(ParamPiece(src, s, 0, r * n, (r + 1) * n, at))
                at += n
                done.add(src)
            specs.append(ParamSpec(f"{pre}.gate_up_proj.weight", dtype, (at,) + shape[1:], device, tuple(pieces)))
            continue
        done.add(name)
        if _ROW_PARALLEL.match(name):
            n = _cut(shape[1], W, f"columns of {name}")
            specs.append(ParamSpec(name, dtype, (shape[0], n), device,
                                   (ParamPiece(name, shape, 1, r * n, (r + 1) * n),)))
        elif name in _VOCAB:
            n = _cut(shape[0], W, f"vocabulary rows of {name}")
            specs.append(ParamSpec(name, dtype, (n,) + shape[1:], device,
                                   (ParamPiece(name, shape, 0, r * n, (r + 1) * n),)))
        elif name.endswith("norm.weight"):
            specs.append(ParamSpec(name, dtype, shape, device, (ParamPiece(name, shape),)))
        else:
            raise ValueError(f"tensor {name!r} has no place in the dense tensor-parallel layout")
    return specs


def fused_specs(trainer: Mapping[str, object], *, num_heads: int, num_kv_heads: int,
                device: str = "cpu") -> list[ParamSpec]:
    """Single-rank fused layout (qkv and gate_up fused, nothing sliced)."""
    return tp_specs(trainer, rank=0, world_size=1, device=device, num_heads=num_heads, num_kv_heads=num_kv_heads)
