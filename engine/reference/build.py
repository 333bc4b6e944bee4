"""Making a :class:`~syncd.engine.reference.engine.ReferenceEngine` (its ``from_*`` constructors): from a local model
folder, from the trainer's tensors and their config (one rank, a simulated tensor-parallel split, or NVFP4 packed
weights), or from a version of a run in the store."""

from __future__ import annotations

from typing import Mapping

import torch

__all__ = ["from_pretrained", "from_state_dict", "from_store"]


def from_pretrained(cls, folder, *, version: int | None = 0, device="cpu", compute_dtype=None, tp_size: int = 1,
                    **kw):
    """From a local model folder (``config.json`` + ``*.safetensors``, as ``make_tiny`` writes)."""
    from transformers import AutoConfig

    from syncd.engine.reference.model import load_folder_weights

    config = AutoConfig.from_pretrained(str(folder))
    return from_state_dict(cls, load_folder_weights(folder), config, version=version, device=device,
                           compute_dtype=compute_dtype, tp_size=tp_size, **kw)


def from_state_dict(cls, state_dict: Mapping[str, torch.Tensor], config, *, version: int | None = 0, device="cpu",
                    compute_dtype=None, tp_size: int = 1, **kw):
    """From the trainer's tensors (names as the transformers model of ``config`` has them) and its config.
    ``tp_size=2`` runs a simulated tensor-parallel split (dense Llama/Qwen2 only): two ranks each holding half of
    each sliced parameter, with fused qkv and gate_up (:mod:`syncd.engine.reference.tp`).

    NVFP4: a state dict holding ``<name>.qdata/.scales/.per_tensor_scale`` triples (what
    ``syncd.trainer.qat.export_nvfp4`` publishes) is detected; those weights are served from their packed parts, which
    are the engine's parameters under those names (:mod:`syncd.engine.reference.nvfp4_weights`). ``tp_size`` must then
    be 1 (ValueError otherwise)."""
    if tp_size == 1:
        from syncd.engine.reference.model import HFRunner

        runner = HFRunner(config, state_dict, device=device, compute_dtype=compute_dtype)
    else:
        from syncd.engine.reference.tp import TPRunner

        runner = TPRunner(config, state_dict, world_size=tp_size, device=device, compute_dtype=compute_dtype)
    return cls(runner, version=version, **kw)


def from_store(cls, store, run_id: str, version: int | None = None, *, config=None, model_dir=None,
               signing_key=None, **kw):
    """From version ``version`` (None: the latest) of a run, rebuilt by ``syncd.materialize`` (every manifest,
    hash and checksum verified). The architecture comes from ``config`` or ``model_dir``'s ``config.json``.
    Raises what ``materialize`` raises."""
    from syncd.versions import latest_version, materialize

    if config is None:
        if model_dir is None:
            raise ValueError("from_store needs config= or model_dir= (the store holds weights only)")
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(model_dir))
    if version is None:
        version = latest_version(store, run_id, signing_key=signing_key)
        if version is None:
            from syncd.errors import VersionNotFound
            raise VersionNotFound(f"run {run_id!r} has no versions")
    weights = materialize(store, run_id, version, signing_key=signing_key)
    return from_state_dict(cls, weights, config, version=version, **kw)
