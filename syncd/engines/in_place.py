"""``InPlaceAdapter``: the whole :class:`~syncd.engines.protocol.Adapter` of an engine whose weights are tensors in
this process, written in place by a :class:`~syncd.engines.updater.WeightUpdater`.

An engine supplies only what is its own, the way checkpoint-engine's worker takes ``run=`` and ``post_hook=``:

* its parameter specs and live tensors (and the trainer tensors it holds none of), when it is built;
* a hook for written parameters (``written``, :data:`syncd.engines.updater.Written`): refresh what it computes
  from the weights (dequantized or packed copies); a failing hook undoes the apply;
* ``pause``/``resume``/``paused``, which it defines itself: they stop and restart its serving.

Everything else of the Adapter -- ``version``, ``parameters``, ``stage``, ``apply``, ``rollback``, ``load_full``,
``checksum`` -- is the updater's, here once for every such engine (``syncd.engine.StateDictEngine``,
``syncd.engine.reference.ReferenceEngine``): an engine subclasses this class instead of forwarding those calls.
``apply``/``rollback``/``load_full`` raise ``RuntimeError`` unless the engine is paused, so a controller that
forgets ``pause()`` is caught here rather than by a corrupted forward pass.

Thread-safety: the Adapter contract (``syncd/engines/protocol.py``); the updater is :attr:`InPlaceAdapter.updater`.
"""

from __future__ import annotations

import abc
from typing import Callable, Iterable, Mapping, Sequence

import torch

from syncd.engines.params import ParamSpec
from syncd.engines.update import Update
from syncd.engines.updater import WeightUpdater, Written

__all__ = ["InPlaceAdapter"]


class InPlaceAdapter(abc.ABC):
    """The Adapter over ``tensors`` (local name -> live tensor, written in place, never copied) described by
    ``specs``; ``version``: what the tensors hold now (None: nothing loaded yet). ``ignore_sources`` and
    ``written``: as :class:`~syncd.engines.updater.WeightUpdater` takes them. ``verify_apply``: ``apply`` checks that
    every staged position still holds its staged old word as it writes (see ``WeightUpdater.apply``).
    ``observe(op, version)``: called after each weight op that succeeded (``stage``, ``apply``, ``rollback``,
    ``load_full``) with its name and the version after it (``stage``: the version staged), for logs and tests.

    A subclass is the engine: it defines :meth:`pause`, :meth:`resume` and :attr:`paused`."""

    def __init__(self, specs: Sequence[ParamSpec], tensors: Mapping[str, torch.Tensor], *,
                 version: int | None = None, ignore_sources: Iterable[str] = (), written: Written | None = None,
                 verify_apply: bool = True, observe: Callable[[str, int | None], object] | None = None):
        self._updater = WeightUpdater(specs, tensors, version=version, ignore_sources=ignore_sources,
                                      written=written)
        self.verify_apply = verify_apply
        self._observe = observe

    # ------------------------------------------------------------------------------------ the engine's own

    @property
    @abc.abstractmethod
    def paused(self) -> bool:
        """True between ``pause`` returning and ``resume``."""

    @abc.abstractmethod
    def pause(self) -> None:
        """Return once no forward pass is running; keep every request and its KV cache."""

    @abc.abstractmethod
    def resume(self) -> None:
        """Continue serving; in-flight requests go on with the new weights."""

    # ------------------------------------------------------------------------------------ the updater's

    @property
    def updater(self) -> WeightUpdater:
        """The update machinery over the engine's tensors (its staged and last applied update, its tensors)."""
        return self._updater

    @property
    def version(self) -> int | None:
        return self._updater.version

    def parameters(self) -> Sequence[ParamSpec]:
        return self._updater.parameters()

    def stage(self, update: Update) -> None:
        self._updater.stage(update)
        self._done("stage", update.version)

    def apply(self) -> None:
        self._need_pause("apply")
        self._updater.apply(verify=self.verify_apply)
        self._done("apply", self.version)

    def rollback(self) -> None:
        self._need_pause("rollback")
        self._updater.rollback()
        self._done("rollback", self.version)

    def load_full(self, update: Update) -> None:
        self._need_pause("load_full")
        self._updater.load_full(update)
        self._done("load_full", self.version)

    def checksum(self, names: Sequence[str] | None = None) -> dict[str, int]:
        return self._updater.checksum(names)

    def _done(self, op: str, version: int | None) -> None:
        if self._observe is not None:
            self._observe(op, version)

    def _need_pause(self, op: str) -> None:
        if not self.paused:
            raise RuntimeError(f"{op} needs the engine paused (call pause() first)")
