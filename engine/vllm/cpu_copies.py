"""What vLLM's CPU kernels compute with, kept in step with the weights syncd writes in place.

vLLM's CPU backend replaces every linear weight with an empty parameter and computes with a private packed copy
(``dispatch_cpu_unquantized_gemm(..., remove_weight=True)``: a oneDNN handle, or an sgl-packed tensor for small
layers), and stores MoE expert weights in ``[E, N/16, K, 16]`` tiles. :func:`install_cpu_gemm_keep` (called
before the model loads) keeps the linear weights so there is something to write; :class:`_Derived` keeps the
packed copies of the layers an update touches in step: a linear layer's new copy is packed while the update is
staged (:meth:`_Derived.prepare`) and swapped in after the write; touched experts are repacked after the write
from a logical copy kept next to the packed tensor (checked against vLLM's own packing at start). On a GPU
nothing is derived. Used by :mod:`syncd.engine.vllm.worker_ext` in vLLM's worker process; the worker's thread calls
:meth:`_Derived.refresh`, the stage thread :meth:`_Derived.prepare` (never at the same time: the front end applies
only a finished stage).
"""

from __future__ import annotations

import time
import types
from dataclasses import dataclass

import torch

__all__ = ["CPU_GEMM_MODES", "install_cpu_gemm_keep"]

#: how vLLM's CPU linear layers compute (``SYNCD_VLLM_CPU_GEMM``, read in the worker): ``onednn`` (vLLM's packed
#: copy, packed for the touched layers while staging) or ``torch`` (``F.linear`` over the live weight: nothing
#: to pack, slower decode)
CPU_GEMM_MODES = ("onednn", "torch")


def install_cpu_gemm_keep(mode: str = "onednn") -> None:
    """Make vLLM's CPU GEMM dispatch keep every linear layer's weight, and with ``mode="torch"`` compute with
    ``F.linear`` over it (idempotent). ValueError for another mode."""
    import vllm.model_executor.layers.utils as lu

    if mode not in CPU_GEMM_MODES:
        raise ValueError(f"SYNCD_VLLM_CPU_GEMM={mode!r}: expected one of {', '.join(CPU_GEMM_MODES)}")
    if getattr(lu.dispatch_cpu_unquantized_gemm, "_syncd_keep", False):
        return
    orig = lu.dispatch_cpu_unquantized_gemm

    def dispatch(layer, remove_weight):  # noqa: ARG001 -- syncd writes the weight in place: keep it
        if mode == "torch" and layer.weight.ndim == 2 and not layer.weight.is_meta:
            layer.cpu_linear = torch.nn.functional.linear
            return None
        return orig(layer, remove_weight=False)

    dispatch._syncd_keep = True
    dispatch._syncd_orig = orig
    lu.dispatch_cpu_unquantized_gemm = dispatch


def _repack_linear(module) -> None:
    module.cpu_linear = _packed_linear(module.weight.data)


def _packed_linear(weight: torch.Tensor):
    """The ``cpu_linear`` vLLM's own CPU GEMM dispatch builds for a linear layer whose weight is ``weight``. It
    computes with a packed copy it owns (oneDNN handle or sgl-packed tensor), so ``weight`` may be dropped after;
    the fallback ``F.linear`` reads the weight it is called with (the live one)."""
    import vllm.model_executor.layers.utils as lu

    holder = types.SimpleNamespace(weight=weight, bias=None)
    getattr(lu.dispatch_cpu_unquantized_gemm, "_syncd_orig", lu.dispatch_cpu_unquantized_gemm)(
        holder, remove_weight=False)
    return holder.cpu_linear


def _experts_isa(module) -> str:
    """The ISA vLLM's CPU experts implementation of ``module`` packs for ('vec', 'amx', ...)."""
    qm = getattr(module, "quant_method", None)
    for holder in (qm, getattr(qm, "moe_kernel", None), getattr(qm, "kernel", None)):
        fe = getattr(holder, "fused_experts", None) or getattr(holder, "experts", None)
        if fe is not None and hasattr(fe, "isa"):
            return fe.isa
    raise RuntimeError(f"no CPU experts implementation with an ISA on {type(module).__name__}")


def _unpack_moe(packed: torch.Tensor) -> torch.Tensor:
    """The logical ``[E, N, K]`` tensor of vLLM's CPU-packed expert weights (``[E, N/16, K, 16]`` tiles)."""
    E, N, K = packed.shape
    return packed.view(E, N // 16, K, 16).permute(0, 1, 3, 2).reshape(E, N, K).contiguous()


def _pack_moe_(logical: torch.Tensor, packed: torch.Tensor, isa: str, experts=None) -> None:
    """Repack experts ``experts`` (all when None) of ``logical`` into ``packed`` with vLLM's own op."""
    op = torch.ops._C.prepack_moe_weight
    if experts is None:
        op(logical, packed, isa)
        return
    for e in experts:
        op(logical[e:e + 1], packed[e:e + 1], isa)


@dataclass
class _Moe:
    module: torch.nn.Module
    attr: str
    logical: torch.Tensor
    isa: str


class _Derived:
    """What vLLM's CPU kernels compute with, rebuilt from the written parameters (see the module docstring)."""

    def __init__(self, model, names):
        self.linear: dict[str, torch.nn.Module] = {}
        self.moe: dict[str, _Moe] = {}
        self._prepared: tuple[object, dict] | None = None  # (the StagedUpdate, name -> its layer's cpu_linear)
        self.swapped = self.rebuilt = 0  # layers the last refresh swapped in from prepare / rebuilt itself
        if not _cpu_backend():
            return
        for name in names:
            mod_name, _, attr = name.rpartition(".")
            mod = model.get_submodule(mod_name)
            if attr in ("w13_weight", "w2_weight"):
                packed = getattr(mod, attr)
                if packed.shape[1] % 16:
                    raise ValueError(f"{name}: {packed.shape[1]} rows is not a multiple of the 16-row CPU tiles")
                isa = _experts_isa(mod)
                logical = _unpack_moe(packed.data)
                check = torch.empty_like(packed.data)
                _pack_moe_(logical, check, isa)
                if not torch.equal(check.view(torch.int32), packed.data.view(torch.int32)):
                    raise RuntimeError(f"{name}: vLLM's CPU expert packing ({isa}) is not the [E, N/16, K, 16] "
                                       "tiling syncd unpacks; refusing to write it")
                self.moe[name] = _Moe(mod, attr, logical, isa)
            elif attr == "weight" and getattr(mod, "cpu_linear", None) not in (None, torch.nn.functional.linear):
                self.linear[name] = mod

    def tensor(self, name: str, param: torch.Tensor) -> torch.Tensor:
        """The tensor syncd writes for parameter ``name`` (the logical copy for packed experts)."""
        m = self.moe.get(name)
        return m.logical if m is not None else param

    def prepare(self, staged) -> float:
        """Build, while vLLM serves, the packed copies the touched linear layers compute with once ``staged``
        (the updater's :class:`~syncd.engines.staging.StagedUpdate`, read against the live weights) is written: each
        layer's weight is copied, the staged words written into the copy, and vLLM's dispatch packs it.
        :meth:`refresh` swaps them in for the same update instead of packing inside the pause; until then the
        touched layers' packed copies exist twice. Raises ``DeltaError`` if a staged old word is not in the live
        weight (it was read from there). Returns the seconds it took."""
        from syncd.engines.params import bf16_view_of_fp32, flat_view, word_view
        from syncd.errors import DeltaError
        from syncd.ops import scatter_words_

        t = time.perf_counter()
        self._prepared = None
        packed = {}
        for p in staged.params:
            mod = self.linear.get(p.name)
            if mod is None:
                continue
            scratch = mod.weight.data.clone()
            words = word_view(flat_view(bf16_view_of_fp32(scratch), p.name)).numpy()
            if scatter_words_([(words, *p.arrays())], verify=True) is not None:
                raise DeltaError(f"{p.name}: the staged old words are not the weight's; stage again")
            packed[p.name] = _packed_linear(scratch)
        self._prepared = (staged, packed)
        return time.perf_counter() - t

    def discard(self) -> None:
        """Drop what :meth:`prepare` built (its memory)."""
        self._prepared = None

    def refresh(self, written, applied=None) -> float:
        """Rebuild what is computed from ``written`` (local name -> staged positions, or None: everything).
        ``applied``: the update just written; linear layers :meth:`prepare` packed for it are swapped in, the
        rest rebuilt here. Returns the seconds it took."""
        t = time.perf_counter()
        names = set(self.linear) | set(self.moe) if written is None else set(written)
        prepared, self._prepared = self._prepared, None
        self.swapped = 0
        if prepared is not None and applied is not None and prepared[0] is applied:
            for name, fn in prepared[1].items():
                if name in names:
                    self.linear[name].cpu_linear = fn
                    names.discard(name)
                    self.swapped += 1
        self.rebuilt = len(names & (set(self.linear) | set(self.moe)))
        for name in names:
            if name in self.linear:
                _repack_linear(self.linear[name])
            elif name in self.moe:
                m = self.moe[name]
                per = m.logical[0].numel()
                experts = None if written is None else torch.unique(written[name].long() // per).tolist()
                _pack_moe_(m.logical, getattr(m.module, m.attr).data, m.isa, experts)
        return time.perf_counter() - t


def _cpu_backend() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()
