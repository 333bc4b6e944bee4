"""``StateDictEngine``: a headless ``syncd.engines.Adapter`` over plain tensors (weights only, no generation).

For daemons, controllers and tests where generation is irrelevant: it takes updates exactly like a serving
engine (the same :class:`~syncd.engines.in_place.InPlaceAdapter`, same contract), including as a tensor-parallel
rank (:meth:`StateDictEngine.from_full` with sliced/fused specs). What is its own: the tensors, a pause flag, and a
log of what happened to it (:attr:`StateDictEngine.events`).

Thread-safety: the Adapter contract (``syncd/engines/protocol.py``). ``apply``/``rollback``/``load_full`` raise
``RuntimeError`` unless paused, so a controller that forgets ``pause()`` is caught here rather than on a
serving engine.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import torch

from syncd.engines.in_place import InPlaceAdapter
from syncd.engines.params import ParamSpec, build_local, identity_specs

__all__ = ["StateDictEngine"]


class StateDictEngine(InPlaceAdapter):
    """An Adapter over ``state_dict`` (local name -> tensor; the engine updates these tensors in place and
    does not copy them). ``specs`` default to one 1:1 parameter per tensor under its own name. ``version``:
    what the tensors hold now (None: nothing loaded yet; then ``load_full`` first)."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor], version: int | None = None, *,
                 specs: Sequence[ParamSpec] | None = None, ignore_sources: Iterable[str] = ()):
        tensors = dict(state_dict)
        self._paused = False
        self.events: list[tuple[str, int | None]] = []  # (op, version after it), for tests and logs
        super().__init__(specs if specs is not None else identity_specs(tensors), tensors, version=version,
                         ignore_sources=ignore_sources, observe=lambda op, v: self.events.append((op, v)))

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

    # --------------------------------------------------------------------------------------- its own

    @property
    def paused(self) -> bool:
        return self._paused

    def pause(self) -> None:
        self._paused = True
        self.events.append(("pause", self.version))

    def resume(self) -> None:
        self._paused = False
        self.events.append(("resume", self.version))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The live local tensors (not copies)."""
        return self.updater.tensors()
