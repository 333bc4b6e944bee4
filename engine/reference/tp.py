"""A simulated tensor-parallel split of a dense Llama/Qwen2 model: ``world_size`` engine ranks in one process,
each holding only its slices of the weights in vLLM's fused layout (:mod:`syncd.engine.sharding`: fused ``qkv_proj``
and ``gate_up_proj``, column-parallel q/k/v, gate/up and vocabulary rows, row-parallel ``o_proj`` and
``down_proj``, replicated norms), and a forward pass of its own over those slices: each rank computes its
heads and its part of the MLP, and the partial outputs are summed (the all-reduce) or concatenated (the
logits' all-gather). The weights exist only as the ranks' slices, so every token this runner produces
depends on the updater's fused/sliced mapping being right.

Local parameter names are ``tp<rank>.<fused name>``; :meth:`TPRunner.rank_specs` gives one rank's specs
under their plain names. Same interface as :class:`~syncd.engine.reference.model.HFRunner`; the scheduler thread
is the only caller of ``forward``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Mapping

import torch
import torch.nn.functional as F

from syncd.engines.params import ParamSpec, build_local
from syncd.engine.reference.model import ConfigLimits, default_compute_dtype, local_view
from syncd.engine.sharding import tp_specs

__all__ = ["TPRunner"]


@dataclass
class _Cache:
    """Per request: for each rank and layer, the keys and values of its kv heads ``[heads, T, head_dim]``."""

    k: list = field(default_factory=list)
    v: list = field(default_factory=list)
    length: int = 0


class TPRunner(ConfigLimits):
    """``world_size`` ranks of a dense Llama/Qwen2 ``config`` loaded from the trainer's ``weights``.
    Raises ValueError for another architecture, rope type or activation, or sizes that do not divide."""

    def __init__(self, config, weights: Mapping[str, torch.Tensor], *, world_size: int = 2, device="cpu",
                 compute_dtype=None):
        if any(k.endswith(".qdata") for k in weights):
            raise ValueError("the tensor-parallel runner does not slice NVFP4 weights (<name>.qdata/.scales/"
                             ".per_tensor_scale); serve an NVFP4 model with tp_size=1")
        if config.model_type not in ("llama", "qwen2"):
            raise ValueError(f"the tensor-parallel runner supports llama and qwen2, not {config.model_type}")
        rope = getattr(config, "rope_parameters", None) or {"rope_type": "default",
                                                            "rope_theta": getattr(config, "rope_theta", 10000.0)}
        if rope.get("rope_type", "default") != "default" or config.hidden_act != "silu":
            raise ValueError("the tensor-parallel runner supports default RoPE and SiLU only")
        if getattr(config, "use_sliding_window", False):
            raise ValueError("the tensor-parallel runner does not support sliding-window attention")
        self.config = config
        self.world_size = W = world_size
        self.device = torch.device(device)
        dtypes = {t.dtype for t in weights.values()}
        if len(dtypes) != 1:
            raise ValueError(f"weights must share one dtype, got {sorted(map(str, dtypes))}")
        self.weights_dtype = dtypes.pop()
        self.compute_dtype = compute_dtype or default_compute_dtype(self.device, self.weights_dtype)
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.layers = config.num_hidden_layers
        self.eps = config.rms_norm_eps
        self.aliases: list[str] = []
        self.num_experts = 0
        self.specs: list[ParamSpec] = []
        self.local_tensors: dict[str, torch.Tensor] = {}
        self.fp32_words: dict[str, torch.Tensor] = {}  # as HFRunner's: the fp32 tensors of bf16 views
        self._rank_specs: list[list[ParamSpec]] = []
        self._w: list[dict[str, torch.Tensor]] = []  # per rank: plain local name -> compute tensor
        for r in range(W):
            specs = tp_specs(weights, rank=r, world_size=W, device=str(self.device), num_heads=self.heads,
                             num_kv_heads=self.kv_heads)
            self._rank_specs.append(specs)
            w = {}
            for s in specs:
                t = build_local(s, weights).to(self.device, self.compute_dtype).contiguous()
                w[s.name] = t
                name = f"tp{r}.{s.name}"
                self.specs.append(replace(s, name=name))
                self.local_tensors[name] = local_view(t, self.weights_dtype)
                if t.dtype != self.weights_dtype:
                    self.fp32_words[name] = t
            self._w.append(w)
        theta = float(rope["rope_theta"])
        d = self.head_dim
        self._inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=self.device) / d))
        self._vocab_per_rank = config.vocab_size // W

    def rank_specs(self, rank: int) -> list[ParamSpec]:
        """Rank ``rank``'s specs under their plain (unprefixed) local names."""
        return list(self._rank_specs[rank])

    def new_cache(self) -> _Cache:
        return _Cache([[None] * self.layers for _ in range(self.world_size)],
                      [[None] * self.layers for _ in range(self.world_size)])

    # ------------------------------------------------------------------------------------ forward

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return w * xf.to(x.dtype)

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        freqs = pos.float()[:, None] * self._inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos[None] + rot * sin[None]

    def forward(self, cache: _Cache, token_ids: list[int]) -> tuple[torch.Tensor, None]:
        """Logits (float32, ``[vocab]``, CPU) of the last of ``token_ids``, run after those in ``cache``."""
        with torch.inference_mode():
            return self._forward(cache, token_ids), None

    def _forward(self, cache: _Cache, token_ids: list[int]) -> torch.Tensor:
        W, T, d = self.world_size, len(token_ids), self.head_dim
        hq, hkv = self.heads // W, self.kv_heads // W
        ids = torch.tensor(token_ids, device=self.device)
        pos = torch.arange(cache.length, cache.length + T, device=self.device)
        # vocabulary-parallel embedding: each rank looks up the ids it owns; the sum is the all-reduce
        x = None
        for r in range(W):
            lo = r * self._vocab_per_rank
            own = (ids >= lo) & (ids < lo + self._vocab_per_rank)
            part = self._w[r]["model.embed_tokens.weight"][(ids - lo).clamp(0, self._vocab_per_rank - 1)]
            part = part * own[:, None].to(part.dtype)
            x = part if x is None else x + part
        causal = torch.ones(T, cache.length + T, dtype=torch.bool, device=self.device).tril(cache.length)
        for i in range(self.layers):
            p = f"model.layers.{i}."
            attn = None
            for r in range(W):
                w = self._w[r]
                h = self._norm(x, w[p + "input_layernorm.weight"])
                qkv = F.linear(h, w[p + "self_attn.qkv_proj.weight"], w.get(p + "self_attn.qkv_proj.bias"))
                q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
                q = self._rope(q.view(T, hq, d).transpose(0, 1), pos)
                k = self._rope(k.view(T, hkv, d).transpose(0, 1), pos)
                v = v.view(T, hkv, d).transpose(0, 1)
                if cache.k[r][i] is not None:
                    k = torch.cat([cache.k[r][i], k], dim=1)
                    v = torch.cat([cache.v[r][i], v], dim=1)
                cache.k[r][i], cache.v[r][i] = k, v
                rep = hq // hkv
                kk, vv = k.repeat_interleave(rep, dim=0), v.repeat_interleave(rep, dim=0)
                scores = (q @ kk.transpose(1, 2)) / math.sqrt(d)
                scores = scores.masked_fill(~causal, float("-inf"))
                out = torch.softmax(scores.float(), dim=-1).to(q.dtype) @ vv
                part = F.linear(out.transpose(0, 1).reshape(T, hq * d), w[p + "self_attn.o_proj.weight"])
                attn = part if attn is None else attn + part
            x = x + attn
            mlp = None
            for r in range(W):
                w = self._w[r]
                h = self._norm(x, w[p + "post_attention_layernorm.weight"])
                gate, up = F.linear(h, w[p + "mlp.gate_up_proj.weight"]).chunk(2, dim=-1)
                part = F.linear(F.silu(gate) * up, w[p + "mlp.down_proj.weight"])
                mlp = part if mlp is None else mlp + part
            x = x + mlp
        cache.length += T
        last = x[-1:]
        logits = [F.linear(self._norm(last, self._w[r]["model.norm.weight"]), self._w[r]["lm_head.weight"])
                  for r in range(W)]
        return torch.cat(logits, dim=-1)[0].float().cpu()
