"""``StateDictEngine``: a headless ``syncd.engines.Adapter`` over plain tensors (weights only, no generation).

For daemons, controllers and tests where generation is irrelevant: it takes updates exactly like a serving
engine (same :class:`~syncd.engine.updater.WeightUpdater`, same contract), including as a tensor-parallel rank
(:meth:`StateDictEngine.from_full` with sliced/fused specs).

Thread-safety: the Adapter contract (``syncd/engines/protocol.py``). ``apply``/``rollback``/``load_full`` raise
``RuntimeError`` unless paused, so a controller that forgets ``pause()`` is caught here rather than on a
serving engine.
"""

from __future__ import annotations

import threading
from typing import Iterable, Mapping, Sequence

import torch

from syncd.engines.params import ParamSpec
from syncd.engines.update import Update
from syncd.engine.updater import WeightUpdater, build_local, identity_specs

__all__ = ["StateDictEngine"]


class StateDictEngine:
    """An Adapter over ``state_dict`` (local name -> tensor; the engine updates these tensors in place and
    does not copy them). ``specs`` default to one 1:1 parameter per tensor under its own name. ``version``:
    what the tensors hold now (None: nothing loaded yet; then ``load_full`` first)."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor], version: int | None = None, *,
                 specs: Sequence[ParamSpec] | None = None, ignore_sources: Iterable[str] = ()):
        tensors = dict(state_dict)
        self._updater = WeightUpdater(specs if specs is not None else identity_specs(tensors), tensors,
                                      version=version, ignore_sources=ignore_sources)
        self._paused = False
        self._lock = threading.Lock()
        self.events: list[tuple[str, int | None]] = []  # (op, version after it), for tests and logs

    @classmethod
    def from_full(cls, full: Mapping[str, torch.Tensor], specs: Sequence[ParamSpec], version: int | None = None,
                  *, ignore_sources: Iterable[str] = ()) -> "StateDictEngine":
        """An engine whose local tensors are cut from the trainer's full tensors by ``specs`` (e.g. one
        tensor-parallel rank)."""
        local = {s.name: build_local(s, full) for s in specs}
        return cls(local, version, specs=specs, ignore_sources=ignore_sources)

    @classmethod
    def empty(cls, specs: Sequence[ParamSpec]) -> "StateDictEngine":
        """An engine with zeroed tensors and no version, waiting for ``load_full``."""
        local = {s.name: torch.zeros(s.shape, dtype=s.dtype, device=s.device) for s in specs}
        return cls(local, None, specs=specs)

    # --------------------------------------------------------------------------------------- Adapter

    @property
    def version(self) -> int | None:
        return self._updater.version

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def updater(self) -> WeightUpdater:
        return self._updater

    def parameters(self) -> Sequence[ParamSpec]:
        return self._updater.parameters()

    def stage(self, update: Update) -> None:
        self._updater.stage(update)
        self.events.append(("stage", update.version))

    def pause(self) -> None:
        self._paused = True
        self.events.append(("pause", self.version))

    def apply(self) -> None:
        self._need_pause("apply")
        self._updater.apply()
        self.events.append(("apply", self.version))

    def rollback(self) -> None:
        self._need_pause("rollback")
        self._updater.rollback()
        self.events.append(("rollback", self.version))

    def load_full(self, update: Update) -> None:
        self._need_pause("load_full")
        self._updater.load_full(update)
        self.events.append(("load_full", self.version))

    def resume(self) -> None:
        self._paused = False
        self.events.append(("resume", self.version))

    def checksum(self, names: Sequence[str] | None = None) -> dict[str, int]:
        return self._updater.checksum(names)

    # --------------------------------------------------------------------------------------- extras

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The live local tensors (not copies)."""
        return self._updater.tensors()

    def _need_pause(self, op: str) -> None:
        if not self._paused:
            raise RuntimeError(f"{op} needs the engine paused (call pause() first)")
