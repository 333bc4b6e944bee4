"""The trainer's fault tolerance on one owner (a rank, or an elastic replica group): per-step checkpoints, peer
replicas, restore, and the durability gate that publishing waits on.

    ft = FaultTolerance(FTConfig(root, owner="rank-1", owners=[...], nodes=[...], replicas=1,
                                 store=..., run_id=...))
    ckpt = ft.restore(step=s)            # local checkpoint of step s, else the peers' replica of it
    ...
    ft.checkpointer.before_update(); opt.step(); ft.checkpointer.save(step, model, opt, state=...)
    ft.durable(step)                     # the step's checkpoint on disk here and offered to its k holders

Layout under ``root`` (node-local disk): ``<owner>/own/step-*`` this owner's checkpoints
(:class:`syncd.trainer.ft.checkpoint.Checkpointer`), ``<owner>/held/<other>/step-*`` the replicas it holds for others
(:class:`syncd.trainer.ft.replicas.ReplicaServer`). The owner's server address goes into the store's peer directory; its
newest durable checkpoint is pushed to the ``replicas`` holders of :func:`syncd.trainer.ft.replicas.place_replicas`.

:meth:`FaultTolerance.available` lists the steps this owner could restore (its own checkpoints that verify, and
the steps its holders have): a plain data-parallel job restores the newest step every rank has
(:func:`agree_step`); an elastic replica group restores its newest and lets torchft heal it from a live peer if
that is behind the others.
"""

from __future__ import annotations

import logging
import shutil
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path

from syncd.trainer.ft.checkpoint import Checkpoint, Checkpointer, list_steps, newest_checkpoint, step_dir
from syncd.trainer.ft.peers import PeerDirectory, Replicator, rebuild_from_peers
from syncd.trainer.ft.replicas import ReplicaError, ReplicaServer, list_replicas, place_replicas, write_bundle

log = logging.getLogger(__name__)

__all__ = ["FTConfig", "FaultTolerance", "agree_step", "default_node"]


def default_node() -> str:
    """This process's node id: ``SYNCD_NODE`` (``{rank}`` in it is replaced by ``RANK``), else the host name."""
    import os

    node = os.environ.get("SYNCD_NODE")
    if node:
        return node.replace("{rank}", os.environ.get("RANK", "0"))
    return socket.gethostname()


@dataclass(frozen=True)
class FTConfig:
    """``root``: node-local folder; ``owner``: this owner's name, one of ``owners`` (every owner of the job, in
    order); ``nodes``: the node of each owner; ``replicas``: k; ``keep``: checkpoints kept (own and held, per
    owner); ``host``: where the replica server binds and what it advertises; ``signing_key``: the run's key
    (None: from the environment, as everywhere in syncd); ``on_busy``: see :class:`Checkpointer`;
    ``gate_timeout_s``: the longest a publish waits for replication."""

    root: str
    owner: str
    owners: tuple
    nodes: tuple
    store: object
    run_id: str
    replicas: int = 1
    keep: int = 2
    host: str = "127.0.0.1"
    signing_key: object = None
    on_busy: str = "wait"
    fsync: bool = True
    gate_timeout_s: float = 120.0
    extra: dict = field(default_factory=dict)


class FaultTolerance:
    """See the module docstring."""

    def __init__(self, cfg: FTConfig):
        self.cfg = cfg
        base = Path(cfg.root) / cfg.owner
        self.own, self.held = base / "own", base / "held"
        self.server = ReplicaServer(self.held, host=cfg.host, keep=cfg.keep, signing_key=cfg.signing_key)
        self.directory = PeerDirectory(cfg.store, cfg.run_id)
        me = list(cfg.owners).index(cfg.owner)
        self.holders = [cfg.owners[j] for j in place_replicas(list(cfg.nodes), cfg.replicas)[me]]
        self.directory.announce(cfg.owner, self.server.url, cfg.nodes[me])
        self.replicator = Replicator(cfg.owner, self.holders, self.directory) if self.holders else None
        self._persisting: threading.Thread | None = None
        self.checkpointer = Checkpointer(self.own, owner=cfg.owner, keep=cfg.keep, on_busy=cfg.on_busy,
                                         fsync=cfg.fsync, signing_key=cfg.signing_key,
                                         on_durable=[self.replicator] if self.replicator else [])
        log.info("%s: checkpoints in %s, replicas to %s, replica server %s", cfg.owner, self.own,
                 self.holders or "nobody", self.server.url)

    # ------------------------------------------------------------------------------------ restore

    def available(self) -> list[int]:
        """Steps this owner could restore, newest first: its own checkpoints that verify, and its holders'."""
        steps = set()
        for s in list_steps(self.own):
            if newest_checkpoint(self.own, owner=self.cfg.owner, signing_key=self.cfg.signing_key, step=s):
                steps.add(s)
        for holder in self.holders:
            where = self.directory.lookup(holder)
            if where is None:
                continue
            try:
                steps.update(list_replicas(where["url"], self.cfg.owner))
            except ReplicaError as exc:
                log.warning("%s: cannot list what %s holds: %s", self.cfg.owner, holder, exc)
        return sorted(steps, reverse=True)

    def restore(self, *, step: int | None = None) -> Checkpoint | None:
        """The checkpoint of ``step`` (None: the newest) from local disk, else rebuilt from the holders' replicas
        (each verified; a corrupt one is skipped with a warning and the next tried); None if there is none."""
        key = self.cfg.signing_key
        c = newest_checkpoint(self.own, owner=self.cfg.owner, signing_key=key, step=step)
        if c is not None:
            log.warning("%s: restoring step %d from the local checkpoint %s", self.cfg.owner, c.step, c.path)
            return self._restored(c)
        got = rebuild_from_peers(self.cfg.owner, self.holders, self.directory, signing_key=key, at_most=step)
        if got is None or (step is not None and got[1].step != step):
            return None
        bundle, c, _ = got
        c.path = step_dir(self.own, c.step)
        self._drop_later(c.step)
        # loaded from memory at once; written to local disk (and offered to the holders again) in the background
        self._persisting = threading.Thread(target=self._persist, args=(bundle, c.step), name="ft-persist",
                                            daemon=True)
        self._persisting.start()
        return c

    def _drop_later(self, step: int) -> None:
        """Later local checkpoints belong to a lineage that did not survive (the job restored an older step)."""
        for s in list_steps(self.own):
            if s > step:
                shutil.rmtree(step_dir(self.own, s), ignore_errors=True)
        self.checkpointer.rescan()  # a dropped later step must not count as durable

    def _restored(self, c: Checkpoint) -> Checkpoint:
        """The restored local checkpoint is this life's first durable one; offered to the holders again (they
        may have lost it) so that the durability of its step is known."""
        self._drop_later(c.step)
        self.checkpointer.mark_durable(c.step)
        if self.replicator is not None:
            self.replicator(c.step, c.path)
        return c

    def _persist(self, bundle, step: int) -> None:
        try:
            path = write_bundle(bundle, self.own)
        except OSError as exc:
            log.warning("%s: the rebuilt step %d could not be written to %s: %s", self.cfg.owner, step, self.own, exc)
            return
        self.checkpointer.mark_durable(step)
        if self.replicator is not None:
            self.replicator(step, path)

    # ------------------------------------------------------------------------------------ durability

    def durable(self, step: int, timeout: float | None = None) -> bool:
        """Wait until a checkpoint of ``step`` or later is on local disk and was offered to every holder; True
        if every holder took it (False: fewer replicas than asked, logged)."""
        if step <= 0:  # the initial weights: always restorable (from the model itself)
            return True
        timeout = self.cfg.gate_timeout_s if timeout is None else timeout
        if not self.checkpointer.wait_durable(step, timeout):
            log.warning("%s: no checkpoint of step %d on disk after %.0f s", self.cfg.owner, step, timeout)
            return False
        if self.replicator is None:
            return True
        took = self.replicator.wait_replicated(step, timeout)
        if set(self.holders) - took:
            log.warning("%s: step %d is replicated on %d of %d holders (%s)", self.cfg.owner, step, len(took),
                        len(self.holders), ", ".join(sorted(set(self.holders) - took)))
            return False
        return True

    def close(self) -> None:
        if self._persisting is not None:
            self._persisting.join()
        self.checkpointer.close()
        if self.replicator is not None:
            self.replicator.close()
        self.server.close()


def agree_step(available_by_rank: list[list[int]]) -> int | None:
    """The newest step every rank can restore (None: there is none)."""
    common = set(available_by_rank[0]) if available_by_rank else set()
    for steps in available_by_rank[1:]:
        common &= set(steps)
    return max(common, default=None)
