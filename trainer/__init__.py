"""Trainer side of syncd: the thin trainer, its fault tolerance, rewards, and the numerics shared with the engines.

Sub-packages by subject, each listing its public names: ``rl`` (the asynchronous RL side: a run's settings, the
step loop, the live side, rollouts, the loss), ``ft`` (fault tolerance: checkpoints, peer replicas, healing, elastic
data parallelism on torchft), ``agent`` (multi-turn tool use: sandboxes, the agent tasks and their verifier QA,
rewards on the trajectory record) and ``rewards`` (reward functions); ``rl`` and ``ft`` do not import each other. The
modules here either wire them -- ``run`` (the command line, ``python -m syncd.trainer.run``) and ``jobs`` (a run as
the plain data-parallel job or the elastic one, both the one step loop) -- or sit below them and import neither:
``dist`` (``torch.distributed`` data parallelism and determinism), ``optim`` (AdamW, Muon), ``qat``
(quantisation-aware training for NVFP4 serving) and ``trl_callback`` (publishing from a TRL trainer).

:class:`WeightPublisher` (``syncd.publish.publisher``) is imported here on first use: the name a trainer imports.
"""

from __future__ import annotations

from syncd.lazy import lazy_names

_LAZY = {
    "WeightPublisher": "syncd.publish.publisher",
}

__all__ = sorted(_LAZY)

__getattr__ = lazy_names("syncd.trainer", _LAZY)
