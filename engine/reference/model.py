"""The reference engine's model runners: what computes next-token logits for one request.

A runner owns the model weights and exposes them to :class:`~syncd.engines.updater.WeightUpdater` as
``specs``/``local_tensors`` in the trainer's dtype (bf16 words as published), while computing in
``compute_dtype``: float32 on CPU (a request's numbers then barely depend on how they are computed, which
keeps sampling reproducible), the weights' dtype on a GPU. With fp32 compute and bf16 weights the fp32
parameters hold bf16-exact values and the updater writes the bf16 words in place
(:func:`syncd.engines.params.bf16_view_of_fp32`); nothing is stored twice. Such a runner lists those fp32
parameters in ``fp32_words`` (local name -> tensor), so that the engine's checksum covers their whole words.

NVFP4 weights (a state dict with ``<name>.qdata/.scales/.per_tensor_scale`` triples, ``docs/nvfp4.md``) are
detected and held by :class:`~syncd.engine.reference.nvfp4_weights.NVFP4Weights`: the packed parts are the
updater's parameters under the trainer's names, and the model parameter ``<name>`` is their dequantized
copy, refreshed by :meth:`HFRunner.weights_written` after every write (only the blocks that changed).

:class:`HFRunner` runs any ``transformers`` causal LM (dense or MoE; the MoE router's top-k expert ids are
captured by forward hooks). Each request has its own KV cache (``DynamicCache``) and its own forward call,
so a request's logits never depend on which other requests are running.

Thread-safety: ``forward`` is called by the engine's scheduler thread only; the weights are written only
while the engine is paused.
"""

from __future__ import annotations

import inspect
import logging
from pathlib import Path
from typing import Mapping

import torch

from syncd.engines.params import ParamPiece, ParamSpec, bf16_view_of_fp32

log = logging.getLogger(__name__)

__all__ = ["HFRunner", "ConfigLimits", "load_folder_weights", "default_compute_dtype", "local_view"]


def default_compute_dtype(device: torch.device | str, weights_dtype: torch.dtype) -> torch.dtype:
    """float32 on CPU; the weights' dtype elsewhere."""
    return torch.float32 if torch.device(device).type == "cpu" else weights_dtype


def local_view(param: torch.Tensor, weights_dtype: torch.dtype) -> torch.Tensor:
    """The live tensor the updater writes for ``param``: itself when dtypes agree, else the bf16 words of
    an fp32 parameter. ValueError for another combination."""
    if param.dtype == weights_dtype:
        return param.detach()
    if param.dtype == torch.float32 and weights_dtype == torch.bfloat16:
        return bf16_view_of_fp32(param)
    raise ValueError(f"cannot compute in {param.dtype} with {weights_dtype} weights (supported: equal dtypes, "
                     "or float32 compute with bfloat16 weights)")


def load_folder_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files in ``folder`` (a model folder as HF tools write it).
    Raises FileNotFoundError if there is none and ValueError for a name found twice."""
    from safetensors.torch import load_file

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {folder}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        for k, v in load_file(str(f)).items():
            if k in out:
                raise ValueError(f"tensor {k!r} is in two files of {folder}")
            out[k] = v
    return out


class ConfigLimits:
    """What the engine asks a runner about the model's HF ``config``: its vocabulary size and how many positions
    it takes."""

    config: object

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def max_positions(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 1 << 30))


class HFRunner(ConfigLimits):
    """A ``transformers`` causal LM built from ``config`` and loaded with ``weights`` (trainer names ->
    tensors, all of one floating dtype: the weights dtype; NVFP4 triples besides, which are dequantized to the
    weights dtype, the dtype ``syncd.trainer.qat.export_nvfp4`` cast the other tensors to). ``device``/
    ``compute_dtype`` as above. Raises ValueError when ``weights`` and the model's state dict differ in names
    or shapes, for an incomplete or malformed NVFP4 triple, and for an NVFP4 weight that is tied to another."""

    def __init__(self, config, weights: Mapping[str, torch.Tensor], *, device="cpu", compute_dtype=None):
        from transformers import AutoModelForCausalLM

        from syncd.lazy import quiet_optional_imports

        quiet_optional_imports()

        from syncd.engine.reference.nvfp4_weights import NVFP4Weights, has_nvfp4

        packed: dict = {}
        if has_nvfp4(weights):
            from syncd.ops import nvfp4

            weights = nvfp4.load_state_dict(weights)  # ValueError for an incomplete or malformed triple
            packed = {n: t for n, t in weights.items() if isinstance(t, nvfp4.NVFP4Tensor)}
        dtypes = {t.dtype for n, t in weights.items() if n not in packed}
        if len(dtypes) > 1 or not (dtypes or packed):
            raise ValueError(f"weights must share one dtype, got {sorted(map(str, dtypes))}")
        self.weights_dtype = dtypes.pop() if dtypes else torch.bfloat16
        self.device = torch.device(device)
        self.compute_dtype = compute_dtype or default_compute_dtype(self.device, self.weights_dtype)
        self.config = config
        with torch.random.fork_rng(devices=[]):  # the random init is overwritten below; leave the caller's RNG alone
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config, dtype=self.compute_dtype)
        model.to(self.device).eval().requires_grad_(False)
        self.model = model
        state = model.state_dict(keep_vars=True)
        missing = [k for k in state if k not in weights]
        extra = [k for k in weights if k not in state]
        if missing or extra:
            raise ValueError(f"weights do not fit {type(model).__name__}: missing {missing[:4]}, "
                             f"unexpected {extra[:4]}")
        self.specs: list[ParamSpec] = []
        self.local_tensors: dict[str, torch.Tensor] = {}
        self.fp32_words: dict[str, torch.Tensor] = {}  # local name -> the fp32 parameter of a bf16 view
        self.aliases: list[str] = []  # tied names: the same storage under a second name
        seen: dict[int, str] = {}
        with torch.no_grad():
            for name, p in state.items():
                w = weights[name]
                if tuple(w.shape) != tuple(p.shape):
                    raise ValueError(f"weight {name!r} has shape {list(w.shape)}, the model {list(p.shape)}")
                key = p.data_ptr()
                if key in seen:
                    if name in packed or seen[key] in packed:
                        raise ValueError(f"NVFP4 weights cannot be tied: {seen[key]!r} and {name!r} share storage")
                    self.aliases.append(name)
                    continue
                seen[key] = name
                if name not in packed:  # NVFP4 weights are dequantized into their parameters below
                    p.copy_(w.to(self.device))
        self.nvfp4 = NVFP4Weights(packed, {n: state[n] for n in packed}, serving_dtype=self.weights_dtype)
        for name in seen.values():  # the model's order; an NVFP4 weight in its place as its three packed parts
            if name in packed:
                self.specs += self.nvfp4.specs(name)
                self.local_tensors.update(self.nvfp4.parts(name))
                continue
            p = state[name]
            self.local_tensors[name] = local_view(p, self.weights_dtype)
            if p.dtype != self.weights_dtype:
                self.fp32_words[name] = p.detach()
            self.specs.append(ParamSpec(name, self.weights_dtype, tuple(p.shape), str(self.device),
                                        (ParamPiece(name, tuple(p.shape)),)))
        self._cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self._routing: list[torch.Tensor] = []
        self.routers = [m for _, m in model.named_modules() if _is_router(m)]
        for m in self.routers:
            m.register_forward_hook(self._capture_routing)
        self.top_k = int(getattr(self.routers[0], "top_k", 0)) if self.routers else 0
        self.num_experts = int(getattr(self.routers[0], "num_experts", 0)) if self.routers else 0

    def weights_written(self, changed: Mapping[str, torch.Tensor] | None, applied=None) -> None:
        """The engine's hook for written parameters (:data:`syncd.engines.updater.Written`): the updater wrote the
        local tensors (while paused); ``changed`` maps local names to the flat positions written (None: every
        tensor may have changed; ``applied`` is not needed here). Refreshes the dequantized copies of NVFP4
        weights whose packed parts changed; nothing else to do (the other tensors are the model's own)."""
        self.nvfp4.refresh(changed)

    @property
    def moe_layers(self) -> int:
        return len(self.routers)

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.config)

    def _capture_routing(self, module, args, output):
        self._routing.append(output[-1].detach().to("cpu", torch.int64))

    def forward(self, cache, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run ``token_ids`` (the tokens after those already in ``cache``) and return the float32 logits of
        the last position (``[vocab]``, CPU) and, for MoE models, the chosen experts
        ``[moe_layers, len(token_ids), top_k]`` (int64), else None."""
        self._routing = []
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        with torch.inference_mode():
            out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **{self._cache_kw: cache})
        logits = out.logits[0, -1].float().cpu()
        routing = torch.stack(self._routing) if self._routing else None
        self._routing = []
        return logits, routing


def _is_router(m: torch.nn.Module) -> bool:
    """A top-k MoE router of ``transformers`` (returns ``(logits, scores, top_k_indices)``)."""
    return type(m).__name__.endswith("TopKRouter") or (
        hasattr(m, "top_k") and hasattr(m, "num_experts") and type(m).__name__.endswith("Router"))
