"""NVFP4 weights in the reference engine: the packed tensors the weight updates write, and the dequantized
copy the model computes with.

A weight ``<name>`` published as NVFP4 (``docs/nvfp4.md``: ``<name>.qdata`` uint8, ``<name>.scales``
float8_e4m3fn, ``<name>.per_tensor_scale`` float32) is held twice:

* the **packed parts**, under the trainer's names: these are the engine's parameters for
  :class:`~syncd.engines.updater.WeightUpdater` (``parameters()``, ``checksum()``, deltas applied in place: only the
  changed bytes of codes and scales move);
* the **dequantized copy**: the model's own parameter ``<name>`` (its compute dtype), holding
  ``syncd.ops.nvfp4.dequantize(parts, serving_dtype)`` exactly, so a plain ``nn.Linear`` forward computes with
  the weights the trainer's QAT forward used, bit for bit, and serving costs what it costs for bf16 weights.

After every write of the packed parts (``apply``, ``rollback``, ``load_full``, all while the engine is
paused) :meth:`NVFP4Weights.refresh` re-dequantizes what changed: the 16-element blocks whose codes or block
scale changed, or the whole weight when its per-tensor scale changed (it scales every block). Dequantization
is elementwise per block, so a partial refresh writes the same bits as a full one.

Thread-safety: ``refresh`` writes the compute parameters and runs only while no forward pass does (the
engine calls it while paused); everything else only reads.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Mapping

import torch

from syncd.engines.params import ParamPiece, ParamSpec, word_view
from syncd.ops import nvfp4
from syncd.ops.nvfp4 import BLOCK, PER_TENSOR_SCALE, QDATA, SCALES, NVFP4Tensor

log = logging.getLogger(__name__)

__all__ = ["NVFP4Weights", "has_nvfp4"]


def has_nvfp4(weights: Mapping[str, object]) -> bool:
    """True when ``weights`` (a state dict) holds NVFP4 parts (a ``<name>.qdata`` entry)."""
    return any(k.endswith(QDATA) for k in weights)


@dataclass(eq=False)
class _Weight:
    name: str
    parts: NVFP4Tensor  # the live packed tensors the updater writes
    param: torch.Tensor  # the model's compute parameter (the dequantized copy)


class NVFP4Weights:
    """The NVFP4 weights of one model: ``packed`` maps a weight's name to its :class:`NVFP4Tensor` (linear
    scales; copied onto ``params[name]``'s device, the caller's tensors are not kept), ``params`` the
    model parameter that weight is (its compute dtype and shape). The parameters are filled at once.
    ``serving_dtype``: what the weights are dequantized to before the cast to the compute dtype (the dtype
    the trainer's QAT forward used: bfloat16 by default; float16 or float32 also work).

    Raises ``ValueError`` for swizzled scales, a shape that differs from the parameter's, or a compute
    dtype the serving dtype's values do not fit exactly (narrower than it)."""

    def __init__(self, packed: Mapping[str, NVFP4Tensor], params: Mapping[str, torch.Tensor], *,
                 serving_dtype: torch.dtype = torch.bfloat16):
        self.serving_dtype = serving_dtype
        self._weights: dict[str, _Weight] = {}
        self._part_owner: dict[str, tuple[str, str]] = {}  # part name -> (weight name, suffix)
        for name, q in packed.items():
            p = params[name]
            if q.swizzled:
                raise ValueError(f"NVFP4 weight {name!r}: the engine loads linear block scales, not swizzled ones")
            if tuple(q.shape) != tuple(p.shape):
                raise ValueError(f"NVFP4 weight {name!r} has shape {list(q.shape)}, the model {list(p.shape)}")
            if p.dtype != serving_dtype and p.dtype != torch.float32:
                raise ValueError(f"NVFP4 weight {name!r}: cannot compute in {p.dtype} with weights dequantized to "
                                 f"{serving_dtype} (compute in {serving_dtype} or float32)")
            own = NVFP4Tensor(*(t.detach().to(p.device, copy=True).contiguous()
                                for t in (q.qdata, q.scales, q.per_tensor_scale)))
            self._weights[name] = _Weight(name, own, p)
            for suffix in (QDATA, SCALES, PER_TENSOR_SCALE):
                self._part_owner[name + suffix] = (name, suffix)
        self.refresh(None)

    # ------------------------------------------------------------------------------------ facts

    @property
    def names(self) -> list[str]:
        """The NVFP4 weights' names (the model parameters that hold dequantized copies)."""
        return list(self._weights)

    def parts(self, name: str) -> dict[str, torch.Tensor]:
        """The live packed tensors of weight ``name`` by their trainer names (``<name>.qdata`` etc.)."""
        q = self._weights[name].parts
        return {name + QDATA: q.qdata, name + SCALES: q.scales, name + PER_TENSOR_SCALE: q.per_tensor_scale}

    def specs(self, name: str) -> list[ParamSpec]:
        """One 1:1 :class:`ParamSpec` per packed part of weight ``name``, under the trainer's names."""
        out = []
        for part, t in self.parts(name).items():
            shape = tuple(t.shape)
            out.append(ParamSpec(part, t.dtype, shape, str(t.device), (ParamPiece(part, shape),)))
        return out

    def packed(self, name: str) -> NVFP4Tensor:
        """Weight ``name``'s live packed tensors as one :class:`NVFP4Tensor` (shares their memory)."""
        return self._weights[name].parts

    @property
    def packed_bytes(self) -> int:
        """Bytes of all packed parts (what a full NVFP4 version of these weights ships)."""
        return sum(w.parts.nbytes for w in self._weights.values())

    # ------------------------------------------------------------------------------------ refresh

    def refresh(self, changed: Mapping[str, torch.Tensor] | None) -> int:
        """Re-dequantize what a write of the packed parts changed. ``changed`` maps local parameter names to
        the flat positions written (any integer dtype and device; e.g. the ``StagedParam.index`` of an
        applied update); names that are not NVFP4 parts are ignored. None refreshes every weight in full. Returns the number of
        16-element blocks dequantized. Call it only while no forward pass runs."""
        todo: dict[str, list[torch.Tensor] | None] = {}  # weight -> changed blocks (None: all of them)
        if changed is None:
            todo = dict.fromkeys(self._weights)
        else:
            for part, positions in changed.items():
                owner = self._part_owner.get(part)
                if owner is None:
                    continue
                name, suffix = owner
                if suffix == PER_TENSOR_SCALE:
                    todo[name] = None  # every block's value changes
                elif todo.get(name, []) is not None:
                    blocks = positions.detach().to("cpu", torch.int64).view(-1)
                    todo.setdefault(name, []).append(blocks // (BLOCK // 2) if suffix == QDATA else blocks)
        n = 0
        with torch.no_grad():
            for name, blocks in todo.items():
                w = self._weights[name]
                if blocks is None:
                    n += self._full(w)
                else:
                    n += self._blocks(w, torch.unique(torch.cat(blocks)))
        if todo:
            log.debug("NVFP4 refresh: %d blocks of %d weights dequantized", n, len(todo))
        return n

    def _full(self, w: _Weight) -> int:
        if w.param.dtype == self.serving_dtype and w.param.is_contiguous():
            w.parts.dequantize(self.serving_dtype, out=w.param)
        else:
            w.param.copy_(w.parts.dequantize(self.serving_dtype))
        return w.param.numel() // BLOCK

    def _blocks(self, w: _Weight, blocks: torch.Tensor) -> int:
        if not blocks.numel():
            return 0
        idx = blocks.to(w.param.device)
        q = w.parts
        scales = q.scales.view(torch.uint8).view(-1, 1).index_select(0, idx)  # float8 has few kernels
        sub = NVFP4Tensor(q.qdata.view(-1, BLOCK // 2).index_select(0, idx), scales.view(q.scales.dtype),
                          q.per_tensor_scale)
        values = nvfp4.dequantize(sub, self.serving_dtype).to(w.param.dtype)
        w.param.view(-1, BLOCK).index_copy_(0, idx, values)
        return int(idx.numel())

    # ------------------------------------------------------------------------------------ checks

    def stale(self) -> list[str]:
        """Names of the weights whose dequantized copy differs (bitwise) from a fresh dequantization of
        their packed parts: empty unless a write bypassed :meth:`refresh`. Costs a full dequantization."""
        out = []
        with torch.no_grad():
            for name, w in self._weights.items():
                fresh = w.parts.dequantize(self.serving_dtype).to(w.param.dtype)
                if not torch.equal(_words(fresh), _words(w.param)):
                    out.append(name)
        return out


def _words(t: torch.Tensor) -> torch.Tensor:
    return word_view(t.detach().contiguous())
