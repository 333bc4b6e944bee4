"""How vLLM lays out a Qwen2/Llama (dense) or Qwen3-MoE model's parameters, as :class:`ParamSpec`\\ s over the
trainer's (Hugging Face) tensor names, for one tensor-parallel rank.

===============================================  ====================================  =========================
vLLM parameter (rank ``r`` of ``W``)             trainer tensors                       cut
===============================================  ====================================  =========================
``...self_attn.qkv_proj.weight`` / ``.bias``     ``q_proj``, ``k_proj``, ``v_proj``    q rows of the rank, then
                                                                                       its kv head(s): replicated
                                                                                       when ``W`` > kv heads
``...mlp.gate_up_proj.weight``                   ``gate_proj``, ``up_proj``            rows of each (dim 0)
``...o_proj.weight``, ``...mlp.down_proj.weight``  same                                columns (dim 1)
``...mlp.experts.routed_experts.w13_weight``     ``...mlp.experts.gate_up_proj``       ``[E, 2I, H]``: gate then
                                                 (transformers 5 fuses the experts)    up rows of the rank (dim 1)
``...mlp.experts.routed_experts.w2_weight``      ``...mlp.experts.down_proj``          ``[E, H, I]``: dim 2
(expert parallel: ``expert_parallel=True``)      the same                              the rank's experts (dim 0),
                                                                                       whole; vLLM's linear
                                                                                       placement
``model.embed_tokens.weight``, ``lm_head.weight``  same                                vocabulary rows (dim 0)
everything else (norms, ``mlp.gate`` router)     same name, same shape                 1:1
===============================================  ====================================  =========================

The specs describe the *logical* layout (what vLLM's loader writes before its CPU backend repacks weights for
its kernels): ``syncd.engine.vllm.worker_ext`` keeps those tensors and rebuilds the packed copies after each write.
Padded layouts (a vocabulary or MoE intermediate size vLLM pads for its kernels) have no exact tiling and are
refused with ``ValueError``, as is a parameter this table does not know.

Expert parallelism (vLLM's ``enable_expert_parallel``, experts split across the ``W`` ranks instead of sliced): rank
``r`` holds ``E // W`` experts (one more on the first ``E % W`` ranks) from ``r * (E // W) + min(r, E % W)`` on,
whole (vLLM's default ``linear`` placement; ``round_robin`` strides the experts, which a piece cannot describe, and
is refused by the worker). Attention, dense MLPs and the vocabulary stay tensor-parallel. Pure functions;
thread-safe.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from syncd.engines.params import ParamPiece, ParamSpec, check_spec

__all__ = ["ModelShape", "vllm_specs", "trainer_name", "expert_slice"]

_QKV = re.compile(r"^(?P<pre>.*\.self_attn)\.qkv_proj\.(?P<kind>weight|bias)$")
_GATE_UP = re.compile(r"^(?P<pre>.*\.mlp)\.gate_up_proj\.weight$")
_ROW_PARALLEL = re.compile(r"^.*\.(self_attn\.o_proj|mlp\.down_proj)\.weight$")
_EXPERTS = re.compile(r"^(?P<pre>.*\.mlp\.experts)\.routed_experts\.(?P<which>w13|w2)_weight$")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class ModelShape:
    """What the mapping needs from the model's config: attention heads, KV heads, head size, hidden size,
    vocabulary, dense and MoE intermediate sizes (0 where the model has none)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    intermediate: int = 0
    moe_intermediate: int = 0
    num_experts: int = 0

    @classmethod
    def from_config(cls, cfg) -> "ModelShape":
        """From a transformers config (or any object with the same attributes)."""
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        return cls(heads, getattr(cfg, "num_key_value_heads", heads), head_dim, cfg.hidden_size, cfg.vocab_size,
                   getattr(cfg, "intermediate_size", 0) or 0, getattr(cfg, "moe_intermediate_size", 0) or 0,
                   getattr(cfg, "num_experts", 0) or 0)


def trainer_name(vllm_name: str) -> str:
    """The trainer tensor a 1:1 vLLM parameter comes from (the experts' stacked weights are renamed)."""
    m = _EXPERTS.match(vllm_name)
    if m:
        return f"{m['pre']}.{'gate_up_proj' if m['which'] == 'w13' else 'down_proj'}"
    return vllm_name


def _split(n: int, world: int, what: str) -> int:
    if n % world:
        raise ValueError(f"{what} ({n}) does not divide into {world} tensor-parallel ranks")
    return n // world


def expert_slice(num_experts: int, rank: int, world_size: int) -> tuple[int, int]:
    """``(first, count)``: the experts rank ``rank`` of ``world_size`` holds under expert parallelism (vLLM's linear
    placement: evenly, the first ``num_experts % world_size`` ranks one more)."""
    base, rem = divmod(num_experts, world_size)
    return rank * base + min(rank, rem), base + (1 if rank < rem else 0)


def vllm_specs(params: Iterable[tuple[str, Sequence[int]]], shape: ModelShape, *, rank: int = 0,
               world_size: int = 1, dtype: torch.dtype = torch.bfloat16, device: str = "cpu",
               expert_parallel: bool = False) -> list[ParamSpec]:
    """The ParamSpecs of vLLM parameters ``params`` (``(name, local shape)`` pairs, as the worker's model has
    them) of tensor-parallel rank ``rank`` of ``world_size`` (``expert_parallel``: the experts split across the
    ranks, not sliced), in the trainer's names (module docstring).
    ``dtype``: the words the trainer publishes (bf16). Each spec is checked to tile its local shape; a
    parameter whose local shape does not fit the config raises ``ValueError`` naming it."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside 0..{world_size - 1}")
    W, r, s = world_size, rank, shape
    specs = []
    for name, local in params:
        local = tuple(int(x) for x in local)
        pieces = _pieces(name, local, s, r, W, expert_parallel)
        spec = ParamSpec(name, dtype, local, device, pieces)
        try:
            check_spec(spec)
        except ValueError as exc:
            raise ValueError(f"vLLM parameter {name!r} {list(local)} does not fit the model's config "
                             f"(padded by vLLM?): {exc}") from None
        specs.append(spec)
    return specs


def _pieces(name: str, local: tuple[int, ...], s: ModelShape, r: int, W: int, ep: bool) -> tuple[ParamPiece, ...]:
    m = _QKV.match(name)
    if m:
        pre, kind = m["pre"], m["kind"]
        tail = () if kind == "bias" else (s.hidden,)
        d = s.head_dim
        nq = _split(s.num_heads, W, "attention heads") * d
        if s.num_kv_heads >= W:
            nkv = _split(s.num_kv_heads, W, "KV heads")
            kv0 = r * nkv * d
        else:  # fewer KV heads than ranks: vLLM replicates one KV head on W / num_kv_heads ranks
            nkv, kv0 = 1, (r * s.num_kv_heads // W) * d
        q_rows, kv_rows = s.num_heads * d, s.num_kv_heads * d
        return (ParamPiece(f"{pre}.q_proj.{kind}", (q_rows,) + tail, 0, r * nq, (r + 1) * nq, 0),
                ParamPiece(f"{pre}.k_proj.{kind}", (kv_rows,) + tail, 0, kv0, kv0 + nkv * d, nq),
                ParamPiece(f"{pre}.v_proj.{kind}", (kv_rows,) + tail, 0, kv0, kv0 + nkv * d, nq + nkv * d))
    m = _GATE_UP.match(name)
    if m:
        n = _split(s.intermediate, W, "intermediate size")
        return (ParamPiece(f"{m['pre']}.gate_proj.weight", (s.intermediate, s.hidden), 0, r * n, (r + 1) * n, 0),
                ParamPiece(f"{m['pre']}.up_proj.weight", (s.intermediate, s.hidden), 0, r * n, (r + 1) * n, n))
    m = _EXPERTS.match(name)
    if m and ep and W > 1:
        E = s.num_experts or local[0] * W
        first, count = expert_slice(E, r, W)
        full = (E,) + local[1:]
        return (ParamPiece(trainer_name(name), full, 0, first, first + count),)
    if m:
        src, E, n = trainer_name(name), local[0], _split(s.moe_intermediate, W, "MoE intermediate size")
        if m["which"] == "w13":
            full = (E, 2 * s.moe_intermediate, s.hidden)
            if W == 1:
                return (ParamPiece(src, full),)
            I_ = s.moe_intermediate
            return (ParamPiece(src, full, 1, r * n, (r + 1) * n, 0),
                    ParamPiece(src, full, 1, I_ + r * n, I_ + (r + 1) * n, n))
        full = (E, s.hidden, s.moe_intermediate)
        return (ParamPiece(src, full),) if W == 1 else (ParamPiece(src, full, 2, r * n, (r + 1) * n),)
    if _ROW_PARALLEL.match(name):
        full = (local[0], local[1] * W)
        return (ParamPiece(name, full),) if W == 1 else (ParamPiece(name, full, 1, r * local[1],
                                                                    (r + 1) * local[1]),)
    if name in _VOCAB:
        full = (s.vocab,) + local[1:]
        n = _split(s.vocab, W, "vocabulary")
        return (ParamPiece(name, full),) if W == 1 else (ParamPiece(name, full, 0, r * n, (r + 1) * n),)
    return (ParamPiece(name, local),)
