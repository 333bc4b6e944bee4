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

**A lighthouse that restarts** (killed and started again on the same address) loses every member; torchft 0.2.0's
manager then never answers the quorum it had asked for, and the new lighthouse numbers its quorums from 1 again, so
a manager that kept its old quorum id may skip reconfiguring its process group and hang. :meth:`begin_step`
therefore asks for each quorum with a bounded wait (:data:`QUORUM_ATTEMPT_S`, at most ``timeout_s``) and, on a
failed attempt, tries again -- as a
**new member** (a fresh manager, store and process group, the same step; :attr:`ElasticDP.rejoins`) whenever the
lighthouse was seen unreachable since this group last joined (a thread polls its status page every
:data:`WATCH_INTERVAL_S`), or after :data:`REJOIN_AFTER_FAILED_COMMITS` steps in a row failed to commit. Every
failed attempt and rejoin is logged and counted; a group that gets no quorum for ``quorum_timeout_s`` raises
RuntimeError naming the lighthouse (the process exits 1 and is restarted by whatever runs it, as after any
failure). The job goes on as soon as the lighthouse answers again.
Thread-safety: the training thread only (the watcher thread only records when the lighthouse did not answer).
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import threading
import time
from datetime import timedelta

import torch

from syncd import http_client

log = logging.getLogger(__name__)

__all__ = ["ElasticDP", "start_lighthouse", "WATCH_INTERVAL_S", "REJOIN_AFTER_FAILED_COMMITS", "QUORUM_ATTEMPT_S"]

#: the longest one quorum attempt waits for the lighthouse's answer before it is asked again (seconds): a lighthouse
#: that died while the attempt was pending never answers it
QUORUM_ATTEMPT_S = 5.0
#: how often each group checks that the lighthouse answers (seconds)
WATCH_INTERVAL_S = 0.25
#: steps in a row that failed to commit before a group rejoins the lighthouse as a new member
REJOIN_AFTER_FAILED_COMMITS = 3


def start_lighthouse(min_replicas: int, *, bind: str = "127.0.0.1:0", join_timeout_ms: int = 1000,
                     heartbeat_timeout_ms: int = 5000, quorum_tick_ms: int = 100, log_file=None,
                     timeout_s: float = 60.0) -> tuple[subprocess.Popen, str]:
    """Start torchft's lighthouse console script; ``(process, "http://HOST:PORT")`` once it answers. The
    caller stops the process. Its log (``RUST_LOG=info`` whatever this process's level: the port is read from
    its "listening on" line) goes to ``log_file`` if given. RuntimeError if it exits or does not answer within
    ``timeout_s``."""
    import queue

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
                if http_client.request("GET", url, "/status", connect_timeout_s=2.0, timeout_s=2.0,
                                       max_reply_bytes=1 << 20).status == 200:
                    break
            except http_client.Unreachable:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the lighthouse at {url} did not answer")
            time.sleep(0.05)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, url


class _LighthouseWatch:
    """Polls the lighthouse's status page every :data:`WATCH_INTERVAL_S` on its own thread; ``down_at``: when it
    last did not answer (monotonic seconds; None: never)."""

    def __init__(self, url: str):
        self.url, self.down_at = url, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lighthouse-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(WATCH_INTERVAL_S):
            try:
                http_client.request("GET", self.url, "/status", connect_timeout_s=1.0, timeout_s=2.0,
                                    max_reply_bytes=1 << 20)
            except Exception:  # noqa: BLE001 -- unreachable, dropped, garbage: all "did not answer"
                if self.down_at is None or time.monotonic() - self.down_at > 1.0:
                    log.warning("the lighthouse at %s does not answer", self.url)
                self.down_at = time.monotonic()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)


class ElasticDP:
    """One replica group (see the module docstring). ``group``: its index (``0..groups-1``, its identity
    across restarts); ``min_replicas``: fewer participants than that never commit a step; ``timeout_s``: how
    long a collective or a transfer may take before the peer counts as gone; ``host``: the address this group
    advertises (its manager and process group)."""

    def __init__(self, *, group: int, groups: int, lighthouse: str, min_replicas: int, state_dict, load_state_dict,
                 transport, timeout_s: float = 30.0, quorum_timeout_s: float = 600.0, host: str = "127.0.0.1"):
        if not 0 <= group < groups:
            raise ValueError(f"replica group {group} is not in [0, {groups})")
        if not 1 <= min_replicas <= groups:
            raise ValueError(f"min_replicas must be in [1, {groups}], got {min_replicas}")
        self.group, self.groups, self.min_replicas = group, groups, min_replicas
        self.lighthouse, self.host, self.timeout_s, self.quorum_timeout_s = lighthouse, host, timeout_s, quorum_timeout_s
        self.is_main = group == 0
        self.healed = False  # this step's quorum loaded a live peer's state (set in begin_step)
        self.restored_step = 0
        self.device = torch.device("cpu")
        self._user = (state_dict, load_state_dict, transport)
        self.rank: int | None = None
        self.world = 0
        self.quorums = self.failed_commits = self.failed_quorums = self.rejoins = 0
        self._failed_in_a_row = 0
        self._join()
        self._watch = _LighthouseWatch(lighthouse)

    def _join(self) -> None:
        """A manager of this group's own (with its store and process group): a new member of the lighthouse."""
        from torch.distributed import TCPStore
        from torchft import Manager, ProcessGroupGloo

        state_dict, load_state_dict, transport = self._user

        def heal(state) -> None:
            load_state_dict(state)
            self.healed = True

        timeout = timedelta(seconds=self.timeout_s)
        self._store = TCPStore(self.host, 0, is_master=True, wait_for_workers=False)
        self._pg = ProcessGroupGloo(timeout=timeout)
        self.manager = Manager(
            pg=self._pg, load_state_dict=heal, state_dict=state_dict, min_replica_size=self.min_replicas,
            use_async_quorum=False, init_sync=False, replica_id=f"group_{self.group}", store_addr=self.host,
            store_port=self._store.port, rank=0, world_size=1, lighthouse_addr=self.lighthouse, hostname=self.host,
            timeout=timeout, quorum_timeout=timedelta(seconds=self.quorum_timeout_s),
            connect_timeout=timedelta(seconds=max(10.0, self.timeout_s)), checkpoint_transport=transport)
        self._joined_at = time.monotonic()

    def _rejoin(self, why: str) -> None:
        """Leave torchft as this member and join again as a new one, at the same step (module docstring)."""
        state = self.manager.state_dict()
        log.warning("group %d: rejoining the lighthouse at %s as a new member at step %d (%s)", self.group,
                    self.lighthouse, state["step"], why)
        self._leave()
        self._join()
        self.manager.load_state_dict(state)
        self.rejoins += 1
        self._failed_in_a_row = 0

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
        True); ``(participant index, participants)``, the index -1 if this group does not take part. A failed
        attempt is tried again (as a new member after the lighthouse was lost; module docstring); RuntimeError
        after ``quorum_timeout_s`` without a quorum."""
        self.healed = False
        deadline = time.monotonic() + self.quorum_timeout_s
        attempt = timedelta(seconds=max(1.0, min(QUORUM_ATTEMPT_S, self.timeout_s, self.quorum_timeout_s)))
        while True:
            lost = self._watch.down_at is not None and self._watch.down_at >= self._joined_at
            try:
                if lost or self._failed_in_a_row >= REJOIN_AFTER_FAILED_COMMITS:
                    self._rejoin("the lighthouse did not answer" if lost
                                 else f"{self._failed_in_a_row} steps in a row failed to commit")
                self.manager.start_quorum(timeout=attempt)
                break
            except Exception as exc:  # noqa: BLE001 -- torchft raises what its Rust side reports
                self.failed_quorums += 1
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"group {self.group}: no quorum from the lighthouse at {self.lighthouse} for "
                                       f"{self.quorum_timeout_s:.0f} s (last: {type(exc).__name__}: {exc}); this "
                                       "group stops: restart it with the same command line") from None
                log.warning("group %d: no quorum for step %d within %.0f s (%s: %s); trying again", self.group,
                            self.step + 1, attempt.total_seconds(), type(exc).__name__, str(exc)[:300])
                # torchft keeps the failed quorum and raises it again on the next start_quorum: forget it
                # (torchft 0.2.0, pinned)
                self.manager._quorum_future = None
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
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
        ``failed_commits``, ``failed_quorums`` (attempts that got no quorum), ``rejoins`` (as a new member) and
        ``restored_step`` (0: started afresh)."""
        from syncd.trainer.dist import weights_digest

        return {"digest": weights_digest(model), "group": self.group, "steps": self.step, "quorums": self.quorums,
                "failed_commits": self.failed_commits, "failed_quorums": self.failed_quorums,
                "rejoins": self.rejoins, "restored_step": self.restored_step}

    def commit(self) -> bool:
        """torchft's vote: True if every participant finished the step (then step the optimizer)."""
        ok = self.manager.should_commit()
        if not ok:
            self.failed_commits += 1
            self._failed_in_a_row += 1
        else:
            self._failed_in_a_row = 0
        return ok

    def _leave(self) -> None:
        try:
            self.manager.shutdown(wait=False)
        except Exception as exc:  # noqa: BLE001 -- shutting down
            log.debug("torchft manager shutdown: %s", exc)
        self._pg.shutdown()  # drops the gloo group: its threads are joined now, not at interpreter exit

    def close(self) -> None:
        self._watch.close()
        self._leave()
