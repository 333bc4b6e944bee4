"""The kept sets of stale rollouts, rebuilt from the weights that sampled them (``docs/trainer-replay.md``).

An engine recording with a kept-set tolerance (the worker's ``--replay-kept-tolerance``) writes most kept sets to be
rebuilt from logits within ``delta`` of its own. The training forward can rebuild them only while the trainer holds
the weights that sampled the token -- never for a group one version behind, the asynchronous loop's usual case
(:class:`syncd.trainer.rl.kept.KeptRebuildError`). :class:`KeptResolver` rebuilds every such set before training,
with :func:`syncd.trainer.rl.logprobs.resolve_kept`: a no-grad recomputation of each position on the version it ran
with, the weights of that version read back from the store (verified as every reader verifies them) -- exactly the
weights the engines applied, in the serving dtype. A rebuilt set is verified against the engine's fingerprint, so it is
the engine's set whichever process rebuilt it: the result does not depend on who resolves, and runs stay
deterministic.

The loop uses it twice:

* the live side's rollout workers resolve each group as it is read back, before it enters the buffer: a group whose
  sets cannot be rebuilt (a set that does not verify, positions of no published version, a version the store no
  longer holds) is dropped like any failed group -- counted (``replay``), its prompt regenerated;
* :func:`syncd.trainer.rl.loop.train` resolves the sequences a process reads from the store itself (the other ranks,
  the elastic job's other groups, offline plans), which the live side verified when it read them.

Sequences whose sets are all listed (a recorder without tolerance, vLLM's ids) pass through untouched, at no cost.

Memory: a scratch model of the same architecture (made on first use, from the model's config, on its device: the
sequences it resolves are moved there and their rebuilt sets back to the CPU) and the weights of the last ``cache``
versions used, as stored (bfloat16). Thread-safety: calls are serialised (one lock).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import OrderedDict

import torch

from syncd.errors import SyncdError
from syncd.trainer.rl.kept import KeptRebuildError
from syncd.trainer.rl.rollouts import Rollout, RolloutSequence

log = logging.getLogger(__name__)

__all__ = ["KeptResolver"]


class KeptResolver:
    """See the module docstring. ``model``: the trainer's model (its architecture, config and device; its weights are
    never read or changed); ``store``/``run_id``: where the versions are; ``signing_key``: as
    :func:`syncd.versions.materialize` takes it (None: the environment's); ``cache``: versions' weights kept."""

    def __init__(self, model: torch.nn.Module, store, run_id: str, *, signing_key=None, cache: int = 4):
        from syncd.store import Store

        if cache < 1:
            raise ValueError(f"cache must be >= 1, got {cache}")
        self.model, self.store, self.run_id = model, Store.open(store), run_id
        self.signing_key, self.cache = signing_key, cache
        self._scratch: torch.nn.Module | None = None
        self._weights: OrderedDict[int, dict] = OrderedDict()
        self._lock = threading.Lock()
        self.sequences = 0  # sequences whose sets were rebuilt
        self.loaded = 0  # versions read from the store

    def __call__(self, sequences: list[RolloutSequence]) -> list[RolloutSequence]:
        """``sequences`` with every kept set listed. Raises :class:`~syncd.trainer.rl.kept.KeptRebuildError` (a set
        that does not verify, or the weights of a version it needs cannot be read) or ValueError (positions the
        engine ran with weights of no published version)."""
        if all(s.kept_pending is None for s in sequences):
            return list(sequences)
        from syncd.trainer.rl.logprobs import resolve_kept

        with self._lock:
            model = self._model()
            dev = next(model.parameters()).device
            out = []
            for seq in sequences:
                if seq.kept_pending is None:
                    out.append(seq)
                    continue
                (got,) = resolve_kept(model, [_moved(seq, dev)], weights_of=self._version_weights)
                out.append(dataclasses.replace(seq, kept_ids=got.kept_ids.cpu(), kept_offsets=got.kept_offsets.cpu(),
                                               kept_pending=None))
                self.sequences += 1
        return out

    def rollouts(self, rollouts: list[Rollout]) -> list[Rollout]:
        """Each rollout with its sequences resolved (``__call__``)."""
        return [ro if all(s.kept_pending is None for s in ro.sequences)
                else dataclasses.replace(ro, sequences=self(ro.sequences)) for ro in rollouts]

    def stats(self) -> dict:
        return {"sequences": self.sequences, "versions_loaded": self.loaded}

    def _model(self) -> torch.nn.Module:
        if self._scratch is None:
            dev = next(self.model.parameters()).device
            cfg = getattr(self.model, "config", None)
            try:
                with torch.device(dev):
                    scratch = type(self.model)(cfg)
            except Exception:  # noqa: BLE001 -- not a config-built model: copy it (its weights are replaced anyway)
                import copy

                scratch = copy.deepcopy(self.model)
            self._scratch = scratch.to(dev).eval().requires_grad_(False)
        return self._scratch

    def _version_weights(self, version: int) -> dict:
        """The weights of ``version``, from the newest cached version in its chain (else its full version) plus the
        deltas after it, each verified (:mod:`syncd.versions`)."""
        from syncd.versions import apply_delta, fetch_shards, load_full, resolve_chain

        have = self._weights.get(version)
        if have is not None:
            self._weights.move_to_end(version)
            return have
        try:
            chain = resolve_chain(self.store, self.run_id, version, signing_key=self.signing_key)
            start = max((i for i, m in enumerate(chain) if m.version in self._weights), default=None)
            if start is None:
                start, weights = 0, load_full(chain[0], fetch_shards(self.store, self.run_id, chain[0]))
            else:
                weights = {k: t.clone() for k, t in self._weights[chain[start].version].items()}
            for base, m in zip(chain[start:], chain[start + 1:]):
                apply_delta(weights, base, m, fetch_shards(self.store, self.run_id, m))
        except SyncdError as exc:
            raise KeptRebuildError(f"the kept sets of tokens sampled with version {version} cannot be rebuilt: its "
                                   f"weights cannot be read from {self.store.url}: {type(exc).__name__}: {exc}"
                                   ) from exc
        self.loaded += 1
        self._weights[version] = weights
        while len(self._weights) > self.cache:
            self._weights.popitem(last=False)
        return weights


def _moved(seq: RolloutSequence, device) -> RolloutSequence:
    """``seq`` with its tensors on ``device`` (where the scratch model computes); itself on the CPU."""
    if torch.device(device).type == "cpu":
        return seq
    moved = {f.name: v.to(device) for f in dataclasses.fields(seq)
             if isinstance(v := getattr(seq, f.name), torch.Tensor)}
    return dataclasses.replace(seq, **moved, kept_pending=seq.kept_pending.to(device))
