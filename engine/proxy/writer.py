"""Writing finished trajectories to the object store so that none is ever lost (used by ``syncd.engine.proxy.server``).

:meth:`RecordWriter.write` stores one :class:`~syncd.engine.proxy.record.Trajectory` with create-if-absent at its
key (``syncd.engine.proxy.record.record_key``). Keys are unique per proxy life:

* an object already at the key with the same bytes is this record (an earlier attempt whose answer was
  lost): written;
* an object there with other bytes is another record -- an earlier life of a proxy with the same sandbox id
  that saw the same trajectory id: the trajectory is renamed ``<id>.<life>`` (then ``<id>.<life>.2``, ...;
  ``life`` is this proxy's start time and a random nonce) and written under the new key; the record keeps
  the client's id as ``requested_trajectory_id``. It never overwrites and never fails for that;
* a store that refuses the write (down, slow, out of space): the record is kept in memory, retried every
  ``retry_s`` (:meth:`RecordWriter.retry_loop`), and at once *spilled*: written to
  ``<spill_dir>/<key>`` (create-if-absent too, renamed the same way), so even a proxy killed before the
  store comes back loses nothing; the spilled file is removed once the store has the record.

:meth:`RecordWriter.drain` (at stop) retries until a deadline and reports every record still unwritten: its
spill file, or -- without a spill directory, or when the disk refused too -- its key, as lost, in the log
and in ``failures("record")``. Each record is handled on its own: one that fails never stops the others.

Thread-safety: one asyncio loop; the store and the disk are called from worker threads.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from pathlib import Path

from syncd.engine.proxy.record import RecordError, Trajectory, check_id
from syncd.engine.spill import spill, unspill

log = logging.getLogger("syncd.engine.proxy.server")

__all__ = ["RecordWriter", "new_life"]

MAX_RENAMES = 64


def new_life() -> str:
    """A proxy life's id: UTC start time and a random nonce (``20250101T120000Z-3fa9c1``), unique across
    restarts of one sandbox's proxy."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(3)


class RecordWriter:
    """Writes, retries and spills the records of one proxy (see the module docstring). ``failures(kind)``
    counts ``"store"`` (a write the store refused) and ``"record"`` (a record neither written nor spilled)."""

    def __init__(self, store, *, life: str, spill_dir: Path | None, retry_s: float, failures):
        self.store, self.life, self.spill_dir, self.retry_s = store, life, spill_dir, retry_s
        self.failures = failures
        self.pending: dict[int, tuple[Trajectory, bytes]] = {}  # id(traj) -> (trajectory, its record bytes)
        self.spilled: dict[int, Path] = {}

    async def write(self, traj: Trajectory) -> bool:
        """Store ``traj``'s record (its ``trajectory_id`` may be renamed); True once the store has it,
        False while it is pending (and spilled, with a spill directory). Raises only
        :class:`~syncd.engine.proxy.record.RecordError` if the record cannot be encoded (nothing is kept then)."""
        try:
            data = traj.encode()
        except (ValueError, TypeError, RecursionError) as exc:
            raise RecordError(f"trajectory {traj.trajectory_id} cannot be encoded as strict JSON: {exc}") from None
        return await self._attempt(traj, data)

    async def _attempt(self, traj: Trajectory, data: bytes) -> bool:
        try:
            written, data = await self._put(traj, data)
        except Exception as exc:  # noqa: BLE001 -- kept and retried; counted below
            log.warning("trajectory record %s not written (%s: %s); kept for retry", traj.key, type(exc).__name__, exc)
            self.failures("store")
            written = False
        if written:
            self.pending.pop(id(traj), None)
            self._unspill(traj)
            return True
        self.pending[id(traj)] = (traj, data)
        if id(traj) not in self.spilled and self.spill_dir is not None:
            await asyncio.to_thread(self._spill, traj)
        return False

    async def _put(self, traj: Trajectory, data: bytes) -> tuple[bool, bytes]:
        from syncd.errors import ObjectExists

        for _ in range(MAX_RENAMES):
            try:
                await asyncio.to_thread(self.store.put, traj.key, data, create=True)
                return True, data
            except ObjectExists:
                existing = await asyncio.to_thread(self.store.get, traj.key, limit=len(data) + 1)
                if bytes(existing) == data:
                    return True, data
            old = traj.key
            data = self._rename(traj)
            log.warning("trajectory record %s exists with another record (an earlier proxy life?); writing %s",
                        old, traj.key)
        raise RecordError(f"no free key for trajectory {traj.trajectory_id} after {MAX_RENAMES} tries")

    def _rename(self, traj: Trajectory) -> bytes:
        """Give ``traj`` the next id of this life (``<id>.<life>``, ``<id>.<life>.2``, ...); returns its
        record bytes under the new id."""
        base, cur = f"{traj.requested_trajectory_id[:100]}.{self.life}", traj.trajectory_id
        n = 1 if cur != base and not cur.startswith(base + ".") else 2 if cur == base else int(cur[len(base) + 1:]) + 1
        traj.trajectory_id = check_id(base if n == 1 else f"{base}.{n}", "trajectory id")
        data = traj.encode()
        if id(traj) in self.pending:
            self.pending[id(traj)] = (traj, data)
        return data

    # ------------------------------------------------------------------------------------ spilling

    def _spill(self, traj: Trajectory) -> None:
        """Blocking: write the pending record to ``<spill_dir>/<key>`` (create-if-absent, renamed on a
        clash with another record); logged and counted if the disk refuses."""
        for _ in range(MAX_RENAMES):
            path = Path(self.spill_dir, traj.key)
            try:
                if not spill(path, self.pending[id(traj)][1]):
                    self._rename(traj)
                    continue
            except OSError as exc:
                log.error("trajectory record %s could not be spilled to %s: %s", traj.key, self.spill_dir, exc)
                return
            self.spilled[id(traj)] = path
            log.warning("trajectory record %s kept in %s until the store takes it", traj.key, path)
            return

    def _unspill(self, traj: Trajectory) -> None:
        unspill(self.spilled.pop(id(traj), None), f"trajectory record {traj.key}", log)

    # ------------------------------------------------------------------------------------ retrying

    async def flush(self) -> None:
        """One retry of every pending record, each on its own."""
        for traj, data in list(self.pending.values()):
            await self._attempt(traj, data)

    async def retry_loop(self) -> None:
        """Retry pending records every ``retry_s`` (run it supervised)."""
        while True:
            await asyncio.sleep(self.retry_s)
            if self.pending:
                await self.flush()

    async def drain(self, deadline: float) -> None:
        """Retry pending records until ``deadline`` (monotonic), then report each one left: spilled (where),
        or lost (its key)."""
        while self.pending and time.monotonic() < deadline:
            await self.flush()
            if self.pending:
                await asyncio.sleep(min(self.retry_s, max(0.0, deadline - time.monotonic())))
        for traj, _ in list(self.pending.values()):
            path = self.spilled.get(id(traj))
            if path is not None:
                log.error("trajectory record %s was not taken by %s; it is saved in %s", traj.key, self.store.url, path)
            else:
                log.error("trajectory record %s could not be written to %s nor spilled, and is lost", traj.key,
                          self.store.url)
                self.failures("record")
