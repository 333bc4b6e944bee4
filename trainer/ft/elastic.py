"""Elastic data parallelism on torchft: one process is one replica group; a per-step quorum decides who trains.

    dp = ElasticDP(group=1, groups=3, lighthouse="http://127.0.0.1:29510", min_replicas=2,
                   state_dict=lambda: {...}, load_state_dict=lambda sd: ..., transport=VerifiedTransport(...))
    while dp.step < steps:
        rank, n = dp.begin_step()               # quorum; a group behind the others heals here (live state)
        ... forward/backward on this participant's share of step dp.step + 1 ...
        dp.all_reduce_grads(params)             # SUM over the participants, one flat buffer in parameter order
        if dp.commit():                         # every participant agrees the step is whole
            opt.step()
        opt.zero_grad()

The lighthouse is torchft's console script (``torchft_lighthouse --min_replicas M --bind HOST:PORT``), or
:func:`start_lighthouse`. Quorum, recovery and the fault-tolerant all-reduce are torchft's
(``torchft.Manager`` with ``ProcessGroupGloo``); what this module fixes:

* **Synchronous quorum, no initial sync** (``use_async_quorum=False``, ``init_sync=False``): a group that joins
  behind heals *before* its forward pass and trains in the same step (with the async quorum it would sit one
  step out with zeroed gradients), and groups that start from the same weights do not heal at step 0 -- with
  both, a run whose membership never changes is bit-identical to one that never failed.
* **Sum, not average**: the loop normalises each step's loss by the step's global token count and splits the
  step's groups over the participants (group ``i`` to participant ``i % n``), so the gradient is a SUM
  (``reduce_op=SUM``) and does not depend on how many groups took part. This is the learning-rate/batch
  policy: **the global batch stays constant**; a shrunk job gives each survivor a larger share of every
  step's batch, with the same learning rate, so the optimisation is the same maths, only slower.
* **torchft's DDP wrapper is not used**: in 0.2.0 it crashes the survivors when a peer dies (its comm hook
  asserts on a future the failed work never set). The loop reduces its own flat buffer with
  ``Manager.allreduce``, whose failure only makes :meth:`commit` return False; the step is then retried with the
  same plan on the next quorum.
* The group's own TCPStore (the Manager connects to one as a client), replica id ``group_<i>`` (torchft appends a
  fresh uuid on every start, so a restarted group is a new member), and the healing transport
  (:class:`syncd.trainer.ft.heal.VerifiedTransport`).

It is the data-parallel object of the one step loop (:func:`syncd.trainer.rl.loop.train`), as
:class:`syncd.trainer.dist.DataParallel` is for a plain job: the loop's :meth:`ElasticDP.begin_step` is the quorum,
its :meth:`ElasticDP.commit` torchft's ``should_commit``, and :attr:`ElasticDP.healed` says whether the quorum
healed this group (what torchft's ``OptimizerWrapper`` does in ``zero_grad`` and ``step``, with the loop's own order).

:meth:`set_step` tells torchft the step a group restored from its checkpoint (or its peers' replicas), so that a
group at the others' step does not heal at all and one behind heals from a live peer.
Thread-safety: the training thread only.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import time
import urllib.request
from datetime import timedelta

import torch

log = logging.getLogger(__name__)

__all__ = ["ElasticDP", "start_lighthouse"]


def start_lighthouse(min_replicas: int, *, bind: str = "127.0.0.1:0", join_timeout_ms: int = 1000,
                     heartbeat_timeout_ms: int = 5000, quorum_tick_ms: int = 100, log_file=None,
                     timeout_s: float = 60.0) -> tuple[subprocess.Popen, str]:
    """Start torchft's lighthouse console script; ``(process, "http://HOST:PORT")`` once it answers. The
    caller stops the process. Its log (``RUST_LOG=info`` whatever this process's level: the port is read from
    its "listening on" line) goes to ``log_file`` if given. RuntimeError if it exits or does not answer within
    ``timeout_s``."""
    import queue
    import threading

    exe = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
    argv = [exe if os.path.exists(exe) else "torchft_lighthouse", "--min_replicas", str(min_replicas), "--bind",
            bind, "--join_timeout_ms", str(join_timeout_ms), "--quorum_tick_ms", str(quorum_tick_ms),
            "--heartbeat_timeout_ms", str(heartbeat_timeout_ms)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "RUST_LOG": "info"})
    lines: queue.Queue[str | None] = queue.Queue()
    listening = threading.Event()

    def drain():  # every line to the log file; until the port is known, to the queue too (the pipe never fills)
        for ln in proc.stdout:
            if log_file is not None:
                log_file.write(ln)
            if not listening.is_set():
                lines.put(ln)
        lines.put(None)

    threading.Thread(target=drain, name="lighthouse-log", daemon=True).start()
    deadline = time.monotonic() + timeout_s
    host = bind.rsplit(":", 1)[0]
    try:
        port = None
        while port is None:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"the lighthouse did not start within {timeout_s} s: {argv}") from None
            if line is None:
                raise RuntimeError(f"the lighthouse exited (status {proc.wait()}) before listening: {argv}")
            if m := re.search(r"listening on: http://[^:\s]+:(\d+)", line):
                port = int(m.group(1))
        listening.set()
        url = f"http://{host}:{port}"
        while True:
            try:
                urllib.request.urlopen(f"{url}/status", timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the lighthouse at {url} did not answer") from None
                time.sleep(0.05)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, url


class ElasticDP:
    """One replica group (see the module docstring). ``group``: its index (``0..groups-1``, its identity
    across restarts); ``min_replicas``: fewer participants than that never commit a step; ``timeout_s``: how
    long a collective or a transfer may take before the peer counts as gone; ``host``: the address this group
    advertises (its manager and process group)."""

    def __init__(self, *, group: int, groups: int, lighthouse: str, min_replicas: int, state_dict, load_state_dict,
                 transport, timeout_s: float = 30.0, quorum_timeout_s: float = 600.0, host: str = "127.0.0.1"):
        from torch.distributed import TCPStore
        from torchft import Manager, ProcessGroupGloo

        if not 0 <= group < groups:
            raise ValueError(f"replica group {group} is not in [0, {groups})")
        if not 1 <= min_replicas <= groups:
            raise ValueError(f"min_replicas must be in [1, {groups}], got {min_replicas}")
        self.group, self.groups, self.min_replicas = group, groups, min_replicas
        self.is_main = group == 0
        self.healed = False  # this step's quorum loaded a live peer's state (set in begin_step)
        self.restored_step = 0

        def heal(state) -> None:
            load_state_dict(state)
            self.healed = True
        self.device = torch.device("cpu")
        self._store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
        timeout = timedelta(seconds=timeout_s)
        self._pg = ProcessGroupGloo(timeout=timeout)
        self.manager = Manager(
            pg=self._pg, load_state_dict=heal, state_dict=state_dict, min_replica_size=min_replicas,
            use_async_quorum=False, init_sync=False, replica_id=f"group_{group}", store_addr=host,
            store_port=self._store.port, rank=0, world_size=1, lighthouse_addr=lighthouse, hostname=host,
            timeout=timeout, quorum_timeout=timedelta(seconds=quorum_timeout_s),
            connect_timeout=timedelta(seconds=max(10.0, timeout_s)), checkpoint_transport=transport)
        self.rank: int | None = None
        self.world = 0
        self.quorums = self.failed_commits = 0

    @property
    def step(self) -> int:
        """Steps committed so far (the next one is ``step + 1``)."""
        return self.manager.current_step()

    def set_step(self, step: int) -> None:
        """The step this group's restored state belongs to (before its first quorum)."""
        self.restored_step = int(step)
        self.manager.load_state_dict({"step": int(step), "batches_committed": 0})

    def begin_step(self) -> tuple[int, int]:
        """Join this step's quorum (healing first if behind: :attr:`step` then moved on, :attr:`healed` is
        True); ``(participant index, participants)``, the index -1 if this group does not take part."""
        self.healed = False
        self.manager.start_quorum()
        self.quorums += 1
        rank, self.world = self.manager.participating_rank(), self.manager.num_participants()
        if rank is None:  # not expected with the synchronous quorum; train nothing, still vote
            log.warning("group %d does not participate in step %d", self.group, self.step + 1)
        self.rank = rank
        return (rank if rank is not None else -1), max(self.world, 1)

    def all_reduce_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Sum every parameter's gradient over this step's participants (a missing one counts as zeros). On a
        peer's failure the gradients are garbage and :meth:`commit` returns False."""
        from torch.distributed import ReduceOp

        from syncd.trainer.dist import flat_grads, set_grads

        flat = flat_grads(params)
        self.manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()
        set_grads(params, flat)

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        from torch.distributed import ReduceOp

        t = torch.tensor(values, dtype=torch.float64)
        self.manager.allreduce(t, reduce_op=ReduceOp.SUM).wait()
        return t.tolist()

    def gather(self, obj) -> list:
        """``[obj]``: replica groups exchange tensors, not objects; each reports its own share (the counterpart
        of :meth:`syncd.trainer.dist.DataParallel.gather`)."""
        return [obj]

    def summary(self, model: torch.nn.Module) -> dict:
        """What this group reports at the end of a run: ``digest`` (its weights,
        :func:`syncd.trainer.dist.weights_digest`), ``group``, ``steps`` committed, ``quorums`` joined,
        ``failed_commits`` and ``restored_step`` (0: started afresh)."""
        from syncd.trainer.dist import weights_digest

        return {"digest": weights_digest(model), "group": self.group, "steps": self.step, "quorums": self.quorums,
                "failed_commits": self.failed_commits, "restored_step": self.restored_step}

    def commit(self) -> bool:
        """torchft's vote: True if every participant finished the step (then step the optimizer)."""
        ok = self.manager.should_commit()
        if not ok:
            self.failed_commits += 1
        return ok

    def close(self) -> None:
        try:
            self.manager.shutdown(wait=False)
        except Exception as exc:  # noqa: BLE001 -- shutting down
            log.debug("torchft manager shutdown: %s", exc)
        self._pg.shutdown()  # drops the gloo group: its threads are joined now, not at interpreter exit
