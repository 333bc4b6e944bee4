"""The trainer's fault tolerance on one owner (a rank, or an elastic replica group): per-step checkpoints, peer
replicas, restore, and the durability gate that publishing waits on.

    ft = FaultTolerance(FTConfig(root, owner="rank-1", owners=[...], nodes=[...], replicas=1,
                                 store=..., run_id=...))
    ckpt = restore_together(ft, dp)      # a plain job: the newest step every rank can restore, verified first
    ckpt = ft.restore()                  # an elastic group: its own newest (local, else its peers' replica)
    ...
    ft.checkpointer.before_update(); opt.step(); ft.checkpointer.save(step, model, opt, state=...)
    ft.durable(step)                     # the step's checkpoint on disk here and offered to its k holders
    ft.drain(); <every rank drained>; ft.close()     # a clean end: the last step reaches every holder

Layout under ``root`` (node-local disk): ``<owner>/own/step-*`` this owner's checkpoints
(:class:`syncd.trainer.ft.checkpoint.Checkpointer`), ``<owner>/held/<other>/step-*`` the replicas it holds for others
(:class:`syncd.trainer.ft.replica_server.ReplicaServer`). The owner's server address goes into the store's peer
directory; its newest durable checkpoint is recorded there and pushed to the ``replicas`` holders of
:func:`syncd.trainer.ft.replicas.place_replicas`. Every transfer presents the job's token (from the job's replica
secret, :mod:`syncd.trainer.ft.replica_secret`), every manifest names the run, and a checkpoint or replica of
another run is refused (:class:`~syncd.trainer.ft.ckpt_format.RunMismatch`, both ids named; :meth:`FaultTolerance.check_run`).

**Restore**: :meth:`FaultTolerance.available` lists the steps this owner may restore (its own checkpoints with a
manifest, and the steps its holders list) -- candidates, not promises: a holder's replica may be corrupt or
foreign. :meth:`FaultTolerance.load` verifies one step completely (its own checkpoint, else each holder's replica
against its owner's record) without changing anything -- or takes one of ``preloaded``, the same step read and verified
ahead (:mod:`syncd.trainer.ft.prefetch`), while its manifest is still the one on disk;
:meth:`FaultTolerance.adopt` makes a loaded step this life's start (later steps dropped, the step re-offered to the
holders that lack it, a rebuilt one written back in the background). A plain data-parallel job restores the newest
step *every* rank has actually loaded (:func:`restore_together`: agree on a candidate, every rank loads it, and if
one cannot, the next older common step is tried); an elastic replica group restores its newest
(:meth:`FaultTolerance.restore`) and lets torchft heal it from a live peer if that is behind the others.
"""

from __future__ import annotations

import logging
import shutil
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path

from syncd.trainer.ft.checkpoint import Checkpoint, Checkpointer, list_steps, newest_checkpoint, step_dir
from syncd.trainer.ft.ckpt_dir import runs_in, write_bundle
from syncd.trainer.ft.ckpt_format import RunMismatch
from syncd.trainer.ft.peers import PeerDirectory, Replicator, rebuild_from_peers
from syncd.trainer.ft.replica_secret import job_secret
from syncd.trainer.ft.replica_server import ReplicaServer
from syncd.trainer.ft.replica_wire import ReplicaError, replica_token
from syncd.trainer.ft.replicas import list_replicas, place_replicas

log = logging.getLogger(__name__)

__all__ = ["FTConfig", "FaultTolerance", "agree_step", "default_node", "own_dir", "restore_together"]


def own_dir(root, owner: str) -> Path:
    """Where ``owner`` keeps its own checkpoints under the node-local ``root``."""
    return Path(root) / owner / "own"


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
    ``gate_timeout_s``: the longest a publish waits for replication; ``secret``: the job's replica secret (None:
    :func:`syncd.trainer.ft.replica_secret.job_secret` of ``root``); ``timeout_s``: the base of every replica
    connection's deadline."""

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
    secret: str | None = None
    timeout_s: float = 120.0
    extra: dict = field(default_factory=dict)


class FaultTolerance:
    """See the module docstring. Raises ValueError when the job's replica secret file is unusable (named)."""

    def __init__(self, cfg: FTConfig):
        self.cfg = cfg
        self.own, self.held = own_dir(cfg.root, cfg.owner), Path(cfg.root) / cfg.owner / "held"
        self.preloaded = []  # syncd.trainer.ft.prefetch.Prefetched: load() uses one while it is current
        secret = cfg.secret if cfg.secret is not None else job_secret(cfg.root)
        self.token = replica_token(secret, cfg.run_id)
        self.server = ReplicaServer(self.held, host=cfg.host, keep=cfg.keep, signing_key=cfg.signing_key,
                                    token=self.token, run_id=cfg.run_id, timeout_s=cfg.timeout_s)
        self.directory = PeerDirectory(cfg.store, cfg.run_id)
        me = list(cfg.owners).index(cfg.owner)
        self.holders = [cfg.owners[j] for j in place_replicas(list(cfg.nodes), cfg.replicas)[me]]
        self.directory.announce(cfg.owner, self.server.url, cfg.nodes[me])
        self.replicator = Replicator(cfg.owner, self.holders, self.directory, token=self.token,
                                     timeout_s=cfg.timeout_s) if self.holders else None
        self._persisting: threading.Thread | None = None
        self.checkpointer = Checkpointer(self.own, owner=cfg.owner, keep=cfg.keep, on_busy=cfg.on_busy,
                                         fsync=cfg.fsync, signing_key=cfg.signing_key, run_id=cfg.run_id,
                                         on_durable=[self.replicator] if self.replicator else [])
        log.info("%s: checkpoints in %s, replicas to %s, replica server %s", cfg.owner, self.own,
                 self.holders or "nobody", self.server.url)

    # ------------------------------------------------------------------------------------ restore

    def check_run(self) -> None:
        """RunMismatch naming both run ids if this owner's checkpoint folder holds checkpoints of another run (or
        of none named): a new run must not continue them, nor write beside them."""
        foreign = runs_in(self.own) - {self.cfg.run_id}
        if foreign:
            theirs = ", ".join(sorted(repr(r) for r in foreign))
            raise RunMismatch(f"{self.own} holds checkpoints of run {theirs}, not of this run {self.cfg.run_id!r}: "
                              "use another folder for this run (or that run's id to continue it)")

    def available(self) -> list[int]:
        """Steps this owner may restore, newest first: its own checkpoints (with a manifest; verified by
        :meth:`load`) and the steps its holders list (verified by :meth:`load`)."""
        steps = set(list_steps(self.own))
        for holder in self.holders:
            where = self.directory.lookup(holder)
            if where is None:
                continue
            try:
                steps.update(list_replicas(where["url"], self.cfg.owner, token=self.token))
            except ReplicaError as exc:
                log.warning("%s: cannot list what %s holds: %s", self.cfg.owner, holder, exc)
        return sorted(steps, reverse=True)

    def load(self, step: int | None = None) -> Checkpoint | None:
        """The checkpoint of ``step`` (None: the newest there is), verified completely -- from local disk, else from
        the holders' replicas (each against its owner's record; a bad one is skipped with the reason and the next
        tried) -- and changing nothing on disk; None if there is none. RunMismatch for another run's local one."""
        key = self.cfg.signing_key
        for pre in self.preloaded:  # read and verified ahead (a warm standby's), used while still the one on disk
            if pre.current(self.own, step):
                return pre.checkpoint
        c = newest_checkpoint(self.own, owner=self.cfg.owner, signing_key=key, step=step, run_id=self.cfg.run_id)
        if c is not None:
            return c
        got = rebuild_from_peers(self.cfg.owner, self.holders, self.directory, signing_key=key, step=step,
                                 token=self.token, run_id=self.cfg.run_id)
        if got is None:
            return None
        bundle, c, _ = got
        c.bundle = bundle  # written to local disk by adopt()
        return c

    def adopt(self, c: Checkpoint) -> Checkpoint:
        """Make the loaded ``c`` this life's start: later local steps are dropped (a lineage that did not survive);
        a local one is durable at once and offered to the holders again (they may have lost it; one that lists
        exactly its manifest is not sent it again); a rebuilt one is written to local disk (and offered to the
        holders) in the background."""
        self._drop_later(c.step)
        self.preloaded = []
        bundle, c.bundle = c.bundle, None
        if bundle is None:
            log.warning("%s: restoring step %d from the local checkpoint %s", self.cfg.owner, c.step, c.path)
            self.checkpointer.mark_durable(c.step)
            if self.replicator is not None:
                self.replicator(c.step, c.path, again=True)
            return c
        c.path = step_dir(self.own, c.step)
        self._persisting = threading.Thread(target=self._persist, args=(bundle, c.step), name="ft-persist",
                                            daemon=True)
        self._persisting.start()
        return c

    def restore(self, *, step: int | None = None) -> Checkpoint | None:
        """:meth:`load` then :meth:`adopt`: the checkpoint of ``step`` (None: the newest that verifies)."""
        c = self.load(step)
        return None if c is None else self.adopt(c)

    def _drop_later(self, step: int) -> None:
        """Later local checkpoints belong to a lineage that did not survive (the job restored an older step)."""
        for s in list_steps(self.own):
            if s > step:
                shutil.rmtree(step_dir(self.own, s), ignore_errors=True)
        self.checkpointer.rescan()  # a dropped later step must not count as durable

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

    def drain(self, timeout: float | None = None) -> bool:
        """A clean end's first half: wait (at most ``timeout``; None: the gate's) until the last checkpoint is
        written and offered to every holder. The job then waits for every owner to drain before any closes its
        replica server (:meth:`close`), so no owner's last push finds its holder gone."""
        timeout = self.cfg.gate_timeout_s if timeout is None else timeout
        if self._persisting is not None:
            self._persisting.join(timeout)
        ok = self.checkpointer.flush(timeout, room_timeout=0)
        return (self.replicator is None or self.replicator.drain(timeout)) and ok

    def close(self) -> None:
        if self._persisting is not None:
            self._persisting.join()
        self.checkpointer.close()
        if self.replicator is not None:
            self.replicator.close()
        self.server.close()


def restore_together(ft: FaultTolerance, ranks) -> Checkpoint | None:
    """The newest step every rank of a plain data-parallel job can actually restore, loaded and adopted on every
    rank (None: there is none). ``ranks``: ``is_main``, ``gather(obj)`` (the list on the main rank) and
    ``broadcast(obj)`` (:class:`syncd.trainer.dist.DataParallel`); every rank calls it. The ranks agree on the
    newest step all of them list; each loads it (verified, nothing changed yet); if any cannot, that step is
    struck off for all and the next older common one is tried -- a poisoned replica costs a step, never the
    restart. A rank whose load raises counts as one that cannot (logged): no rank is left waiting for it. Check
    the run first (:meth:`FaultTolerance.check_run` on every rank)."""
    avail = ft.available()
    tried: set[int] = set()
    while True:
        listed = ranks.gather([s for s in avail if s not in tried])
        step = ranks.broadcast(agree_step(listed) if ranks.is_main else None)
        if step is None:
            return None
        try:
            c = ft.load(step)
        except Exception:  # noqa: BLE001 -- this rank cannot: the others must hear it, not wait for it
            log.exception("%s: loading step %d failed", ft.cfg.owner, step)
            c = None
        loaded = ranks.gather(c is not None and c.step == step)
        if ranks.broadcast(all(loaded) if ranks.is_main else None):
            return ft.adopt(c)
        tried.add(step)
        log.warning("%s: step %d cannot be restored on every rank; trying an older step", ft.cfg.owner, step)


def agree_step(available_by_rank: list[list[int]]) -> int | None:
    """The newest step every rank can restore (None: there is none)."""
    common = set(available_by_rank[0]) if available_by_rank else set()
    for steps in available_by_rank[1:]:
        common &= set(steps)
    return max(common, default=None)
