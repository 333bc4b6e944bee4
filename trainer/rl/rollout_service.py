"""The rollout service: a long-lived process that owns prompt dispatch, whether or not a trainer is alive.

    syncd rollouts --store URL --run-id RUN --proxy URL [--proxy URL ...] --task NAME --max-backlog 16

It runs the rollout workers (:class:`syncd.trainer.rl.rollout_workers.RolloutWorkers`: prompts through the sandbox
proxies to the engines, each completion scored, every trajectory finished with its reward and read back with its
replay records) and writes each finished group to the run's queue in the store
(:mod:`syncd.trainer.rl.group_queue`), where the trainer reads it. Its prompt ledger is the queue itself:

* before any request of an attempt is sent, the attempt is **claimed** (a create-only object), so no attempt is
  ever sent twice, across restarts and even by two copies of one service;
* a group that fails (an HTTP error, a record not written, a reward that raised) is marked failed and its prompt
  sent again as the next attempt; so is a group the trainer sends back (dropped by its buffer policy, refused by
  its checks: ``failed/`` objects ``by: "trainer"``, polled every ``--poll-interval-s``);
* on start, the service lists its claims, groups and failures: an attempt claimed but neither finished nor failed
  was in flight when the last life died -- it is marked ``orphaned``, its trajectories still open in the proxy are
  finished as dropped, and the prompt is sent again as the next attempt. Fresh prompts continue after the highest
  one claimed. No prompt is lost.

**Backlog.** Groups written and not yet read by the trainer (its ``consumer.json``), plus those in flight, never
exceed ``--max-backlog``: past it the service pauses dispatch (nothing is dropped) until the trainer reads; with no
trainer alive it fills the backlog and waits, so the engines keep generating through a trainer outage for as long
as the backlog lasts. Several services split the prompts (``--share K/N``: the indices ``i`` with ``i % N == K``),
each with its own ``--service-id``.

A group records the newest valid version in the store at its request (``requested_version``, refreshed every
``--poll-interval-s``, at least 2 s) and the trainer's step from its position (what a reward with phases by step
reads); its tokens carry the versions that sampled them (the replay records). The service keeps
no other state: restarting it, or starting a second one with another share, needs nothing but the store.

Every long-lived task survives every exception: a failing store or trainer position is logged, counted
(:meth:`RolloutService.stats`, ``errors``) and retried; a fatal task error (an exhausted curation pool) stops the
workers, and ``main`` exits 1 naming it. Thread-safety: :meth:`start`, :meth:`stop`, :meth:`stats` from any thread.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from syncd.errors import ObjectExists, StoreError
from syncd.supervise import Failures
from syncd.trainer.rl.group_queue import MAX_ATTEMPT, GroupQueue, QueueError, check_service

log = logging.getLogger(__name__)

__all__ = ["ServiceConfig", "RolloutService", "QueueSink", "rollout_flags", "main"]

ERROR_KINDS = ("consumer", "failed_poll", "version", "store")


class QueueSink:
    """The rollout workers' side of the queue (what :class:`RolloutWorkers` calls its buffer): which prompt comes
    next, what failed, where a finished group goes -- every decision durable in the store before it takes effect
    (the module docstring). ``share``: ``(k, n)``; ``close_open(claim)``: finishes an orphaned attempt's open
    trajectories. Thread-safety: every method from any thread."""

    def __init__(self, queue: GroupQueue, service: str, *, share: tuple[int, int] = (0, 1), stop: threading.Event,
                 backoff_max_s: float = 5.0):
        self.q, self.service, (self.k, self.n), self._stop = queue, check_service(service), share, stop
        self.backoff_max_s = backoff_max_s
        self._lock = threading.Lock()
        self._append = threading.Lock()  # groups are numbered in the order they are written: no gap survives
        self._regen: deque[tuple[int, int]] = deque()
        self._latest: dict[int, int] = {}  # prompt -> its newest claimed attempt
        self._inflight: dict[int, int] = {}
        self._seen_failed: set[tuple[int, int]] = set()
        self.cursor, self.next_seq = self.k, 0
        self.counts = {"claimed": 0, "landed": 0, "failed": 0, "orphaned": 0, "returned": 0, "abandoned": 0}
        self.closed = False

    def mine(self, index: int) -> bool:
        return index % self.n == self.k

    def recover(self, close_open) -> dict:
        """Rebuild the ledger from the store (module docstring); returns what it found."""
        st = self.q.state(self.service, accept=self.mine)
        for (i, a) in st.claims:
            self._latest[i] = max(a, self._latest.get(i, -1))
        orphans = []
        for i, a in sorted(self._latest.items()):
            if (i, a) in st.failed:
                self._again(i, a)
            elif (i, a) not in st.landed:
                orphans.append((i, a))
        for i, a in orphans:
            self.q.fail(i, a, "orphaned: the rollout service restarted while it was in flight", by="service")
            close_open(st.claims[(i, a)])
            self._again(i, a)
        self._seen_failed = set(st.failed) | set(orphans)
        top = max(self._latest, default=-1)
        self.cursor = top + 1 + (self.k - (top + 1)) % self.n
        self.next_seq = st.next_seq
        self.counts["orphaned"] = len(orphans)
        found = {"claims": len(st.claims), "landed": len(st.landed), "failed": len(st.failed),
                 "orphaned": len(orphans), "regenerate": len(self._regen), "cursor": self.cursor,
                 "next_seq": self.next_seq, "skipped": len(st.skipped)}
        for key, why in st.skipped.items():
            log.warning("rollout queue: skipped %s: %s", key, why)
        return found

    def _again(self, index: int, attempt: int) -> None:
        if attempt >= MAX_ATTEMPT:
            self.counts["abandoned"] += 1
            log.error("prompt %d failed %d attempts: abandoned", index, attempt + 1)
            return
        self._regen.append((index, attempt + 1))

    def poll_returned(self) -> int:
        """Prompts the trainer sent back since the last poll, queued to be sent again; returns how many."""
        st_failed = {}
        for info in self.q.store.list(self.q.prefix + "failed/"):
            name = info.key.rsplit("/", 1)[-1]
            try:
                i, a = int(name[:10]), int(name[11:14])
            except ValueError:
                continue
            st_failed[(i, a)] = info.key
        n = 0
        with self._lock:
            for (i, a) in sorted(st_failed):
                if (i, a) in self._seen_failed or not self.mine(i):
                    continue
                self._seen_failed.add((i, a))
                if self._latest.get(i) == a and i not in self._inflight:
                    self._again(i, a)
                    self.counts["returned"] += 1
                    n += 1
        return n

    # ------------------------------------------------------------------------------------ RolloutWorkers' calls

    def next_prompt(self, entry_of=None, accept=None) -> tuple[int, int] | None:
        """The next ``(index, attempt)``, claimed in the store; blocks through store failures (retried with
        backoff); None once the service stops."""
        backoff = 0.2
        while True:
            if self._stop.is_set() or self.closed:
                return None
            with self._lock:
                if self._regen:
                    i, a = self._regen.popleft()
                else:
                    i, a = self.cursor, 0
                    self.cursor += self.n
            entry = entry_of(i, a) if entry_of is not None else {}
            try:
                self.q.claim(i, a, {**entry, "service": self.service})
            except ObjectExists:  # sent before, by another life or another copy of this service: never again
                log.error("attempt %d of prompt %d was claimed before; it is sent as the next attempt", a, i)
                self.q.fail(i, a, "claimed twice", by="service")
                with self._lock:
                    self._latest[i] = max(a, self._latest.get(i, -1))
                    self._again(i, a)
                continue
            except StoreError as exc:
                log.warning("claiming attempt %d of prompt %d: %s (retried)", a, i, exc)
                with self._lock:
                    self._regen.appendleft((i, a))
                self._stop.wait(backoff)
                backoff = min(self.backoff_max_s, backoff * 2)
                continue
            with self._lock:
                self._latest[i] = a
                self._inflight[i] = a
                self.counts["claimed"] += 1
            return i, a

    def record_written(self, index: int, sandbox: str) -> None:
        """(The workers report the first record of a group; the queue needs nothing from it.)"""

    def failed(self, index: int) -> None:
        """The in-flight group of ``index`` failed: marked so, its prompt sent again."""
        with self._lock:
            a = self._inflight.pop(index, None)
            if a is None:
                return
            self._seen_failed.add((index, a))
            self.counts["failed"] += 1
        try:
            self.q.fail(index, a, "the group failed in the rollout service", by="service")
        except StoreError as exc:  # a restart would find it orphaned and mark it then
            log.warning("marking attempt %d of prompt %d failed: %s", a, index, exc)
        with self._lock:
            self._again(index, a)

    def put(self, group) -> bool:
        """Append the finished group to the queue as this service's next one (retried through store failures
        until written or the service stops: a number once given is never left empty), with the service's
        ``frontier``: the lowest prompt of its share not landed (what the trainer's buffer policy measures its
        target mix below, ``syncd.trainer.rl.buffer_policy``)."""
        with self._lock:  # every prompt of this share below it has landed (this one does now)
            frontier = min([self.cursor, *(i for i, _ in self._regen),
                            *(i for i in self._inflight if i != group.item.index)])
        doc = {**group.plan(), "token_versions": group.token_versions, "attempt": group.attempt,
               "frontier": frontier}
        backoff = 0.2
        with self._append:
            while True:
                try:
                    self.q.append(self.service, self.next_seq, doc)
                    break
                except ObjectExists:
                    log.error("group number %d of service %s was written by another writer: is a second copy of "
                              "this service running? Stopping.", self.next_seq, self.service)
                    self.close()
                    return False
                except StoreError as exc:
                    if self._stop.is_set():
                        return False
                    log.warning("writing group %d of prompt %d: %s (retried)", self.next_seq, group.item.index, exc)
                    self._stop.wait(backoff)
                    backoff = min(self.backoff_max_s, backoff * 2)
            self.next_seq += 1
        with self._lock:
            self._inflight.pop(group.item.index, None)
            self.counts["landed"] += 1
        return True

    def close(self) -> None:
        self.closed = True

    def stats(self) -> dict:
        with self._lock:
            return {**self.counts, "cursor": self.cursor, "next_seq": self.next_seq, "inflight": len(self._inflight),
                    "regenerate": len(self._regen)}


@dataclass
class ServiceConfig:
    """What ``syncd rollouts`` is given (its flags, :func:`parser`)."""

    store: str
    run_id: str
    proxies: list[str]
    service_id: str = "rollouts-0"
    share: tuple[int, int] = (0, 1)
    task: str = "repeat"
    task_length: int = 8
    reward: str | None = None
    group_size: int = 8
    workers: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    max_backlog: int = 16
    poll_interval_s: float = 0.5
    vocab_size: int | None = None
    request_timeout_s: float = 120.0
    record_timeout_s: float = 60.0
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        check_service(self.service_id)
        k, n = self.share
        for flag, ok in (("--share", n >= 1 and 0 <= k < n), ("--max-backlog", self.max_backlog >= 1),
                         ("--group-size", self.group_size >= 2), ("--workers", self.workers >= 1),
                         ("--proxy", bool(self.proxies)), ("--poll-interval-s", 0 < self.poll_interval_s < 3600)):
            if not ok:
                raise ValueError(f"{flag}: out of range in {self}")


class RolloutService:
    """The service (module docstring): :meth:`start` recovers the ledger, starts the workers and the pacer."""

    def __init__(self, cfg: ServiceConfig):
        self.cfg = cfg
        self.queue = GroupQueue(cfg.store, cfg.run_id)
        self._stop = threading.Event()
        self.sink = QueueSink(self.queue, cfg.service_id, share=cfg.share, stop=self._stop)
        self.errors = Failures(ERROR_KINDS)
        self.version = self.step = 0
        self.workers = None
        self.recovered: dict | None = None
        self._pacer = threading.Thread(target=self._pace, name="rollout-service-pacer", daemon=True)

    def start(self) -> "RolloutService":
        from syncd.trainer.rl.rollout_workers import RolloutWorkers, Sampling, proxy_models
        from syncd.trainer.rl.tasks import get_task, load_reward

        cfg = self.cfg
        task = get_task(cfg.task, length=cfg.task_length)
        self.workers = RolloutWorkers(
            proxies=list(cfg.proxies), model_name=proxy_models(cfg.proxies[0])[0], task=task,
            reward=load_reward(cfg.reward) if cfg.reward else task.reward, group_size=cfg.group_size,
            sampling=Sampling(cfg.temperature, cfg.top_p, cfg.top_k), store=cfg.store, run_id=cfg.run_id,
            buffer=self.sink, version=lambda: self.version, step=lambda: self.step, workers=cfg.workers, seed=cfg.seed,
            vocab_size=cfg.vocab_size, request_timeout_s=cfg.request_timeout_s,
            record_timeout_s=cfg.record_timeout_s)
        self._refresh_version()
        self.recovered = self.sink.recover(self.workers.close_open)
        log.info("rollout service %s (share %d/%d, life %s): recovered %s", cfg.service_id, *cfg.share,
                 self.workers.life, self.recovered)
        self.workers.start()
        self._pacer.start()
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        self.sink.close()
        if self.workers is not None:
            self.workers.stop(timeout_s)
        if self._pacer.is_alive():
            self._pacer.join(timeout_s)

    @property
    def stopped(self) -> bool:
        return self._stop.is_set() or self.sink.closed

    def stats(self) -> dict:
        return {"service": self.cfg.service_id, "version": self.version, "queue": self.sink.stats(),
                "workers": self.workers.stats() if self.workers is not None else None,
                "errors": self.errors.totals, "recovered": self.recovered}

    def _refresh_version(self) -> None:
        from syncd.versions import latest_version

        try:
            v = latest_version(self.cfg.store, self.cfg.run_id)
            self.version = self.version if v is None else v
        except (StoreError, ValueError) as exc:
            self.errors("version")
            log.warning("reading the run's newest version: %s", exc)

    def _pace(self) -> None:
        """Keep ``unread + in flight + credit`` at ``--max-backlog``; take back what the trainer returned."""
        cfg, last_version = self.cfg, 0.0
        while not self._stop.wait(cfg.poll_interval_s):
            try:
                if time.monotonic() - last_version > max(2.0, cfg.poll_interval_s):
                    self._refresh_version()
                    last_version = time.monotonic()
                try:
                    self.sink.poll_returned()
                except StoreError as exc:
                    self.errors("failed_poll")
                    log.warning("polling the prompts the trainer returned: %s", exc)
                try:
                    consumer = self.queue.consumer()
                    read = int(consumer["read"].get(cfg.service_id, 0))
                    step = consumer.get("step")
                    self.step = step if isinstance(step, int) and not isinstance(step, bool) else self.step
                except (StoreError, QueueError) as exc:
                    self.errors("consumer")
                    log.warning("reading the trainer's position: %s (the backlog holds)", exc)
                    continue
                w = self.workers.stats()
                unread = max(0, self.sink.next_seq - read)
                want = cfg.max_backlog - unread - w["inflight"] - w["credit"]
                if want > 0:
                    self.workers.allow(want)
            except Exception:  # noqa: BLE001 -- the pacer must outlive anything; counted and logged
                self.errors("store")
                log.exception("rollout service pacer")


def rollout_flags(p: argparse.ArgumentParser, *, workers_help: str) -> None:
    """The flags of what is generated, shared by ``syncd train`` and ``syncd rollouts``."""
    from syncd.trainer.rl.tasks import DEFAULT_TASK, task_names

    a = p.add_argument
    a("--task", default=DEFAULT_TASK, metavar="NAME[:OPTIONS]",
      help=f"one of {', '.join(task_names())} (syncd.trainer.rl.tasks; lookup, bugfix and detect are multi-turn, "
           "with tools in sandboxes: syncd.trainer.rl.agent_tasks); OPTIONS set the reward stack on the trajectory "
           "record, e.g. lookup:length=50/20/40,latency=100/0.5 (docs/agent-harness.md)")
    a("--task-length", type=int, default=8, help="answer length in tokens")
    a("--reward", default=None, metavar="MODULE:ATTR",
      help="reward function replacing the task's (syncd.trainer.rl.tasks.Sample -> float)")
    a("--group-size", type=int, default=8, help="G: samples per prompt")
    a("--workers", type=int, default=None, help=workers_help)
    a("--temperature", type=float, default=1.0)
    a("--top-p", type=float, default=1.0)
    a("--top-k", type=int, default=0, help="0: off")


def _share(text: str) -> tuple[int, int]:
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected K/N (e.g. 0/2), got {text!r}") from None
    return k, n


def parser() -> argparse.ArgumentParser:
    env = os.environ.get
    from syncd.cli_help import HelpFormatter

    p = argparse.ArgumentParser(prog="syncd rollouts", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    a = p.add_argument
    a("--store", default=env("SYNCD_STORE"), help="store URL of the run [SYNCD_STORE]")
    a("--run-id", default=env("SYNCD_RUN_ID"), help="the run [SYNCD_RUN_ID]")
    a("--proxy", action="append", default=[], metavar="URL", help="sandbox proxy in front of the frontend (repeat)")
    a("--service-id", default=env("SYNCD_ROLLOUT_SERVICE", "rollouts-0"),
      help="this service's name in the queue [SYNCD_ROLLOUT_SERVICE]")
    a("--share", type=_share, default="0/1", metavar="K/N", help="the prompts i with i %% N == K")
    a("--max-backlog", type=int, default=16, help="groups written and unread by the trainer, plus in flight")
    a("--poll-interval-s", type=float, default=0.5, help="how often the trainer's position is read")
    a("--seed", type=int, default=0, help="the run's seed (task items, sampling seeds)")
    a("--vocab-size", type=int, default=None, help="the model's vocabulary, to check recorded token ids")
    a("--request-timeout-s", type=float, default=120.0)
    a("--record-timeout-s", type=float, default=60.0, help="seconds to wait for a group's replay records")
    a("--log-level", default=env("SYNCD_LOG_LEVEL", "INFO"), help="[SYNCD_LOG_LEVEL]")
    rollout_flags(p, workers_help="groups generated at once (default: 4)")
    return p


def main(argv=None) -> int:
    """Entry point of ``syncd rollouts``: serves until SIGTERM/SIGINT (exit 0) or a fatal error (exit 1)."""
    from syncd.urls import check_http_url

    args = parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for flag, var, value in (("--store", "SYNCD_STORE", args.store), ("--run-id", "SYNCD_RUN_ID", args.run_id)):
        if not value:
            print(f"syncd rollouts: {flag} (or {var}) is required", file=sys.stderr)
            return 2
    try:
        for u in args.proxy:
            check_http_url(u, "--proxy")
        cfg = ServiceConfig(store=args.store, run_id=args.run_id, proxies=list(args.proxy),
                            service_id=args.service_id, share=args.share, task=args.task,
                            task_length=args.task_length, reward=args.reward, group_size=args.group_size,
                            workers=args.workers or 4, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, max_backlog=args.max_backlog,
                            poll_interval_s=args.poll_interval_s, vocab_size=args.vocab_size,
                            request_timeout_s=args.request_timeout_s, record_timeout_s=args.record_timeout_s)
        svc = RolloutService(cfg).start()
    except ValueError as exc:
        print(f"syncd rollouts: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 -- a proxy that does not answer, a store that cannot be listed
        print(f"syncd rollouts: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    while not done.wait(1.0) and not svc.stopped:
        pass
    failed = svc.stopped and not done.is_set()
    svc.stop()
    if failed:
        print(f"syncd rollouts: stopped: {svc.stats()['workers']['last_error']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
