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

**Backlog.** Groups written and not yet read by the trainer (its ``consumer.json``), those it read and holds in
its buffer, not yet taken by a step (``held``), plus those in flight, never exceed the limit: past it the service
pauses dispatch (nothing is dropped) until the trainer takes some. While the trainer's position doc changes (its
heartbeat, every poll of its feed) the limit is the trainer's ``lookahead`` (what it wants generated ahead, as its
staleness bound allows); once it has not changed for ``--trainer-timeout-s`` (the trainer is away) the limit is
``--max-backlog``, so the engines keep generating through a trainer outage for as long as that backlog lasts.
Several services split the prompts (``--share K/N``: the indices ``i`` with ``i % N == K``), each with its own
``--service-id``.

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
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

from syncd.errors import StoreError
from syncd.supervise import Failures
from syncd.trainer.rl.group_queue import GroupQueue, QueueError, check_service
from syncd.trainer.rl.queue_ledger import QueueSink

log = logging.getLogger(__name__)

__all__ = ["ServiceConfig", "RolloutService", "rollout_flags", "main"]

ERROR_KINDS = ("consumer", "failed_poll", "version", "store")


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
    trainer_timeout_s: float = 10.0
    vocab_size: int | None = None
    request_timeout_s: float = 120.0
    record_timeout_s: float = 60.0
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        check_service(self.service_id)
        k, n = self.share
        for flag, ok in (("--share", n >= 1 and 0 <= k < n), ("--max-backlog", self.max_backlog >= 1),
                         ("--group-size", self.group_size >= 2), ("--workers", self.workers >= 1),
                         ("--proxy", bool(self.proxies)), ("--poll-interval-s", 0 < self.poll_interval_s < 3600),
                         ("--trainer-timeout-s", 0 < self.trainer_timeout_s < 86400)):
            if not ok:
                raise ValueError(f"{flag}: out of range in {self}")


class RolloutService:
    """The service (module docstring): :meth:`start` recovers the ledger, starts the workers and the pacer. Started
    inside a trainer's process (one machine), it is given the trainer's ``task`` object (a curated one keeps its
    estimates in the trainer's checkpoint), ``reward``, and ``version()``/``step()`` instead of reading them from the
    store."""

    def __init__(self, cfg: ServiceConfig, *, task=None, reward=None, version=None, step=None):
        self.cfg = cfg
        self._task, self._reward, self._version_of, self._step_of = task, reward, version, step
        self.queue = GroupQueue(cfg.store, cfg.run_id)
        self._stop = threading.Event()
        self.sink = QueueSink(self.queue, cfg.service_id, share=cfg.share, stop=self._stop)
        self.errors = Failures(ERROR_KINDS)
        self.version = self.step = 0
        self.trainer_alive = False
        self.workers = None
        self.recovered: dict | None = None
        self._pacer = threading.Thread(target=self._pace, name="rollout-service-pacer", daemon=True)

    def start(self) -> "RolloutService":
        from syncd.trainer.rl.rollout_workers import RolloutWorkers, Sampling, proxy_models
        from syncd.trainer.rl.tasks import get_task, load_reward

        cfg = self.cfg
        task = self._task or get_task(cfg.task, length=cfg.task_length)
        reward = self._reward or (load_reward(cfg.reward) if cfg.reward else task.reward)
        self.workers = RolloutWorkers(
            proxies=list(cfg.proxies), model_name=proxy_models(cfg.proxies[0])[0], task=task, reward=reward,
            group_size=cfg.group_size, sampling=Sampling(cfg.temperature, cfg.top_p, cfg.top_k), store=cfg.store,
            run_id=cfg.run_id, buffer=self.sink, version=self._version_of or (lambda: self.version),
            step=self._step_of or (lambda: self.step), workers=cfg.workers, seed=cfg.seed,
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
        return {"service": self.cfg.service_id, "version": self.version, "trainer_alive": self.trainer_alive,
                "queue": self.sink.stats(),
                "workers": self.workers.stats() if self.workers is not None else None,
                "errors": self.errors.totals, "recovered": self.recovered}

    def _refresh_version(self) -> None:
        from syncd.versions import latest_version

        if self._version_of is not None:
            return

        try:
            v = latest_version(self.cfg.store, self.cfg.run_id)
            self.version = self.version if v is None else v
        except (StoreError, ValueError) as exc:
            self.errors("version")
            log.warning("reading the run's newest version: %s", exc)

    def _pace(self) -> None:
        """Keep ``unread + in flight + credit`` at ``--max-backlog``; take back what the trainer returned."""
        cfg, last_version = self.cfg, 0.0
        beat, beat_at = None, -float("inf")  # the trainer's last heartbeat seen, and when (this clock)
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
                    held = consumer.get("held") if isinstance(consumer.get("held"), dict) else {}
                    held = held.get(cfg.service_id, 0)
                    held = held if isinstance(held, int) and not isinstance(held, bool) and held >= 0 else 0
                    if consumer.get("t") != beat:
                        beat, beat_at = consumer.get("t"), time.monotonic()
                    ahead = consumer.get("lookahead")
                    step = consumer.get("step")
                    self.step = step if isinstance(step, int) and not isinstance(step, bool) else self.step
                except (StoreError, QueueError) as exc:
                    self.errors("consumer")
                    log.warning("reading the trainer's position: %s (the backlog holds)", exc)
                    continue
                w = self.workers.stats()
                unread = max(0, self.sink.next_seq - read)
                limit = cfg.max_backlog
                if isinstance(ahead, int) and not isinstance(ahead, bool) and ahead >= 1 \
                        and time.monotonic() - beat_at < cfg.trainer_timeout_s:
                    limit = min(limit, ahead)
                self.trainer_alive = time.monotonic() - beat_at < cfg.trainer_timeout_s
                want = limit - unread - held - w["inflight"] - w["credit"]
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
    a("--max-backlog", type=int, default=16,
      help="groups written and not taken by the trainer, plus in flight, while the trainer is away")
    a("--poll-interval-s", type=float, default=0.5, help="how often the trainer's position is read")
    a("--trainer-timeout-s", type=float, default=10.0,
      help="the trainer's position unchanged this long: it is away, and the backlog grows to --max-backlog")
    a("--seed", type=int, default=0, help="the run's seed (task items, sampling seeds)")
    a("--vocab-size", type=int, default=None, help="the model's vocabulary, to check recorded token ids")
    a("--request-timeout-s", type=float, default=120.0)
    a("--record-timeout-s", type=float, default=60.0, help="seconds to wait for a group's replay records")
    a("--log-level", default=env("SYNCD_LOG_LEVEL", "INFO"), help="[SYNCD_LOG_LEVEL]")
    rollout_flags(p, workers_help="groups generated at once (default: 4)")
    return p


def main(argv=None) -> int:
    """Entry point of ``syncd rollouts``: serves until SIGTERM/SIGINT (exit 0) or a fatal error (exit 1), then
    prints its stats as one JSON line."""
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
                            poll_interval_s=args.poll_interval_s, trainer_timeout_s=args.trainer_timeout_s,
                            vocab_size=args.vocab_size,
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
    print(json.dumps(svc.stats()), flush=True)  # the last line: what it did (requests, failures, the queue)
    if failed:
        print(f"syncd rollouts: stopped: {svc.stats()['workers']['last_error']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
