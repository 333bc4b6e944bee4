"""An engine in the daemon's own process as an :class:`~syncd.engines.protocol.EngineLink`: the same control
state an engine process's routes give (:class:`syncd.engines.client.RemoteAdapter`), so the daemon drives both
kinds alike."""

from __future__ import annotations

import uuid
from typing import Sequence

from syncd.engines.update import Update

__all__ = ["InProcessLink"]


class InProcessLink:
    """``adapter`` (any :class:`~syncd.engines.protocol.Adapter` in this process) with a control state.

    Every weight write made through the link (``apply``, ``rollback``, ``load_full``; a failed ``load_full``
    counts, it may have written some weights) moves ``writes``, as an engine process's counter does;
    ``instance`` is fixed for the link's life. There is no lease to hold -- nothing outside this process
    can reach the adapter -- so ``lease()`` is ``state()`` and ``release()`` does nothing; ``run_id`` is None
    (an in-process engine does not say whose weights it holds). Calls pass straight to the adapter, on the
    caller's thread (the Adapter contract's threading rules hold)."""

    url = "in-process"

    def __init__(self, adapter):
        self.adapter = adapter
        self.instance = uuid.uuid4().hex
        self.writes = 0
        self.last_writes: int | None = None

    def __repr__(self) -> str:
        return f"InProcessLink({self.adapter!r})"

    # ------------------------------------------------------------------------------------- control state

    def state(self) -> dict:
        return {"run_id": None, "version": self.adapter.version, "writes": self.writes, "instance": self.instance,
                "lease": None}

    def lease(self) -> dict:
        return self.state()

    def release(self) -> None:
        pass

    # ------------------------------------------------------------------------------------- Adapter

    @property
    def version(self) -> int | None:
        return self.adapter.version

    def parameters(self) -> Sequence:
        return self.adapter.parameters()

    def stage(self, update: Update) -> None:
        self.adapter.stage(update)

    def pause(self) -> None:
        self.adapter.pause()

    def apply(self) -> None:
        self.adapter.apply()  # a failed apply leaves the weights as they were (the Adapter contract)
        self._wrote()

    def rollback(self) -> None:
        self.adapter.rollback()
        self._wrote()

    def load_full(self, update: Update) -> None:
        try:
            self.adapter.load_full(update)
        finally:
            self._wrote()

    def resume(self) -> None:
        self.adapter.resume()

    def checksum(self, names: Sequence[str] | None = None) -> dict[str, int]:
        return self.adapter.checksum(names)

    def _wrote(self) -> None:
        self.writes += 1
        self.last_writes = self.writes
