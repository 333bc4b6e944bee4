"""Rollout workers: each task item's prompt goes ``G`` times to the engines through a sandbox proxy (HTTP, the
OpenAI completions route, in front of the Dynamo frontend); the records come back through the store.

For item ``i`` a worker thread sends ``G`` requests at once to proxy ``i % len(proxies)``, each its own
trajectory (``X-Syncd-Trajectory``), with the sampling of the config (temperature, top-p, top-k) and a seed made
of the run's seed, ``i`` and the sample number. It scores each completion text with the reward function (the
sandbox's view of the answer), finishes each trajectory with ``{"task", "item", "sample", "reward", ...}`` as
its metadata (so the store holds the reward with the record), and reads the group back with
:func:`syncd.trainer.rl.rollouts.read_rollouts`, waiting up to ``record_timeout_s`` for the engines' replay records,
which they write in the background once a request ends. The group (rewards, versions of its tokens) goes into the
:class:`~syncd.trainer.rl.buffer.RolloutBuffer`.

Which prompt comes next is the sink's answer: the rollout service's ledger in the run's queue
(:class:`syncd.trainer.rl.queue_ledger.QueueSink`, what the trainer's groups come from), or a local
:class:`RolloutBuffer`'s prompt ledger (:meth:`RolloutBuffer.next_prompt`; benchmarks and tests that generate
without a trainer): a prompt whose group failed is regenerated before a fresh one, as attempt 1, 2, ... (its
trajectory ids ``<life>-g<index>r<attempt>-s<j>``, unique per life of the workers). :meth:`close_open` finishes an
earlier life's trajectories still open in the proxy.

Production is paced by credit: :meth:`RolloutWorkers.allow` lets ``n`` more groups start (the rollout service
keeps its backlog with it: ``syncd.trainer.rl.rollout_service``).

Failures (HTTP errors, a record not written or incomplete, records that do not join) never reach the buffer:
the group is dropped whole (its trajectories still open in the proxy are finished with ``{"dropped": reason}``),
logged, counted by kind in :attr:`RolloutWorkers.failures`, its prompt queued to be regenerated and its credit
given back, and the worker goes on after a backoff -- except for an error marked ``fatal`` (an exhausted curation
pool), which stops the workers and closes the buffer, so the trainer's wait ends with the cause in
:meth:`RolloutWorkers.stats`. A task with an ``observe`` method (:class:`syncd.trainer.rl.curation.CuratedTask`) is told
each group's rewards once the group is in the buffer. Records are trusted only after ``read_rollouts`` checked them.

A ``multi_turn`` task runs an episode per sample (:mod:`syncd.trainer.rl.episodes`: read back as one sequence per run
of turns that extend each other); its reward, or one with ``needs_record``, gets the open record (``Sample.record``);
a reward's ``(value, info)`` puts ``info`` in the trajectory's ``metadata["reward_info"]``.

Thread-safety: :meth:`allow`, :meth:`stats` and :meth:`stop` from any thread; ``reward`` is called from the worker
threads (one call at a time per worker).
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable

from syncd import http_client
from syncd.store import Store
from syncd.supervise import Failures
from syncd.trainer.rl import episodes
from syncd.trainer.rl.buffer import Group, RolloutBuffer
from syncd.trainer.rl.group_reader import GroupReader, _Failed, _make_group
from syncd.trainer.rl.tasks import RewardFn, Sample, Task, TaskItem

log = logging.getLogger(__name__)

__all__ = ["Sampling", "RolloutWorkers", "ProxyError", "proxy_models", "complete", "FAILURE_KINDS"]

TRAJECTORY_HEADER = "X-Syncd-Trajectory"
FAILURE_KINDS = ("request", "record", "replay", "reward", "task")


class ProxyError(RuntimeError):
    """A proxy answered with an error, or could not be reached."""

    kind = "request"


@dataclass(frozen=True)
class Sampling:
    """What every request asks for: ``top_k`` 0 and ``top_p`` 1.0 are off."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        if not 0 < self.temperature < float("inf"):
            raise ValueError(f"temperature must be finite and > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: off), got {self.top_k}")


def _http(url: str, method: str, path: str, body: dict | None = None, headers: dict | None = None,
          timeout_s: float = 30.0) -> tuple[int, object]:
    """One JSON exchange with the proxy (syncd.http_client): ``(status, reply)``; ProxyError when unreachable."""
    try:
        return http_client.request_json(method, url, path, body, headers=headers, connect_timeout_s=timeout_s,
                                        timeout_s=timeout_s)
    except (http_client.Unreachable, http_client.ReplyTooLarge, ValueError) as exc:
        raise ProxyError(f"{url}{path}: {type(exc).__name__}: {exc}") from None


def proxy_models(url: str, timeout_s: float = 10.0) -> list[str]:
    """The model names the proxy's frontend serves; :class:`ProxyError` when it answers none or fails."""
    status, body = _http(url, "GET", "/v1/models", timeout_s=timeout_s)
    if status != 200 or not isinstance(body, dict):
        raise ProxyError(f"{url}/v1/models answered HTTP {status}: {body}")
    names = [m.get("id") for m in body.get("data") or [] if isinstance(m, dict) and m.get("id")]
    if not names:
        raise ProxyError(f"{url}: the frontend behind it lists no model (no engine serving)")
    return names


def complete(url: str, body: dict, trajectory_id: str, *, timeout_s: float = 120.0) -> dict:
    """One non-streamed ``/v1/completions`` request through the proxy at ``url`` as trajectory
    ``trajectory_id``; the response, or :class:`ProxyError` (unreachable, an error status, no choices)."""
    status, out = _http(url, "POST", "/v1/completions", body, {TRAJECTORY_HEADER: trajectory_id}, timeout_s=timeout_s)
    if status != 200 or not isinstance(out, dict) or not out.get("choices"):
        raise ProxyError(f"trajectory {trajectory_id}: HTTP {status}: {str(out)[:300]}")
    return out


def _seed(seed: int, index: int, sample: int, attempt: int = 0) -> int:
    key = f"{seed}:{index}:{sample}" if attempt == 0 else f"{seed}:{index}.{attempt}:{sample}"
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "little") >> 1


def _tids(life: str, index: int, attempt: int, group_size: int) -> list[str]:
    again = f"r{attempt}" if attempt else ""
    return [f"{life}-g{index:06d}{again}-s{j:02d}" for j in range(group_size)]


class RolloutWorkers:
    """See the module docstring. ``version()``/``step()``: the trainer's current version and step (recorded with
    each group, and given to the reward). ``workers``: groups produced at once. ``buffer``: where prompts come from
    and groups go: a :class:`RolloutBuffer`, or the rollout service's queue
    (:class:`syncd.trainer.rl.queue_ledger.QueueSink`, whose ``next_prompt`` answers None once it stopped)."""

    def __init__(self, *, proxies: list[str], model_name: str, task: Task, reward: RewardFn, group_size: int,
                 sampling: Sampling, store, run_id: str, buffer: RolloutBuffer, version: Callable[[], int],
                 step: Callable[[], int], workers: int = 4, seed: int = 0, vocab_size: int | None = None,
                 request_timeout_s: float = 120.0, record_timeout_s: float = 60.0):
        if not proxies:
            raise ValueError("rollout workers need at least one proxy URL")
        if group_size < 2:
            raise ValueError(f"a group needs at least 2 samples to normalise advantages, got {group_size}")
        self.proxies, self.model_name, self.task, self.reward = list(proxies), model_name, task, reward
        self.group_size, self.sampling, self.run_id, self.buffer = group_size, sampling, run_id, buffer
        self.store = Store.open(store)
        self.version, self.step, self.seed, self.vocab_size = version, step, seed, vocab_size
        self.request_timeout_s, self.record_timeout_s = request_timeout_s, record_timeout_s
        self.life = secrets.token_hex(3)  # trajectory ids unique to this trainer life
        self.multi_turn = episodes.episodic(task) is not None
        self.reader = GroupReader(self.store, run_id, vocab_size=vocab_size, record_timeout_s=record_timeout_s,
                                  multi_turn=self.multi_turn)
        self.with_record = self.multi_turn or episodes.wants_record(reward)
        self.failures, self.last_error = Failures(FAILURE_KINDS), None
        self.groups = self.requests = self.tokens = self._credit = self._inflight = 0
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(workers * group_size, thread_name_prefix="rollout-request")
        self._threads = [threading.Thread(target=self._loop, name=f"rollout-worker-{i}", daemon=True)
                         for i in range(workers)]

    # ------------------------------------------------------------------------------------ control

    def start(self) -> "RolloutWorkers":
        for t in self._threads:
            t.start()
        return self

    def allow(self, n: int) -> None:
        """Let ``n`` more groups start."""
        with self._cond:
            self._credit += n
            self._cond.notify_all()

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self._pool.shutdown(wait=False, cancel_futures=True)

    def stats(self) -> dict:
        with self._cond:
            return {"groups": self.groups, "requests": self.requests, "tokens": self.tokens,
                    "inflight": self._inflight, "credit": self._credit, "failures": self.failures.totals,
                    "last_error": self.last_error}

    # ------------------------------------------------------------------------------------ work

    def _loop(self) -> None:
        backoff = 0.2
        while not self._stop.is_set():
            with self._cond:
                while self._credit <= 0 and not self._stop.is_set():
                    self._cond.wait(0.5)
                if self._stop.is_set():
                    return
                self._credit -= 1
                self._inflight += 1
            got = self.buffer.next_prompt(self._entry)
            if got is None:  # the sink stopped (syncd.trainer.rl.queue_ledger.QueueSink)
                return
            index, attempt = got
            try:
                group = self._group(index, attempt)
            except Exception as exc:  # noqa: BLE001 -- counted, logged, the credit given back, the worker goes on
                kind = getattr(exc, "kind", "task")
                self.failures(kind)
                self.last_error = f"group {index}: {type(exc).__name__}: {exc}"
                if getattr(exc, "fatal", False):  # no retry can succeed (syncd.trainer.rl.curation.CurationExhausted)
                    log.error("rollout %s failure, the workers stop: %s", kind, self.last_error)
                    self._stop.set()
                    self.buffer.close()  # the trainer's take() raises BufferClosed; stats() name the cause
                    return
                log.warning("rollout %s failure: %s", kind, self.last_error)
                self.buffer.failed(index)
                with self._cond:
                    self._inflight -= 1
                    self._credit += 1
                self._stop.wait(backoff)
                backoff = min(5.0, backoff * 2)
                continue
            backoff = 0.2
            with self._cond:
                self._inflight -= 1
                self.groups += 1
                self.tokens += group.tokens
            self.buffer.put(group)
            observe = getattr(self.task, "observe", None)  # syncd.trainer.rl.curation.CuratedTask: only groups buffered
            if observe is not None:
                try:
                    observe(group.item, group.rewards)
                except Exception as exc:  # noqa: BLE001 -- the group is buffered; only its estimate is lost
                    self.failures("task")
                    self.last_error = f"group {index}: observe: {type(exc).__name__}: {exc}"
                    log.warning("rollout task failure: %s", self.last_error)

    def _body(self) -> dict:
        return {"model": self.model_name, "max_tokens": self.task.max_tokens, "temperature": self.sampling.temperature,
                "top_p": self.sampling.top_p, "top_k": self.sampling.top_k, "ignore_eos": self.task.ignore_eos}

    def _complete(self, proxy: str, tid: str, item: TaskItem, seed: int) -> dict:
        with self._cond:
            self.requests += 1
        return complete(proxy, {**self._body(), "max_tokens": self.task.max_tokens_for(item), "prompt": item.prompt,
                                "seed": seed}, tid, timeout_s=self.request_timeout_s)

    def _episode(self, proxy: str, tid: str, item: TaskItem, seed: int) -> dict:
        out = episodes.run_episode(episodes.episodic(self.task), item, url=proxy, tid=tid, body=self._body(),
                                   seed=seed, http=_http, error=ProxyError, header=TRAJECTORY_HEADER,
                                   timeout_s=self.request_timeout_s)
        with self._cond:
            self.requests += out["turns"]
        return out


    def _entry(self, index: int, attempt: int) -> dict:
        """The ledger's record of a group being requested."""
        return {"attempt": attempt, "life": self.life, "proxy": self.proxies[index % len(self.proxies)],
                "trajectories": _tids(self.life, index, attempt, self.group_size), "requested_version": self.version()}

    def _group(self, index: int, attempt: int = 0) -> Group:
        item = self.task.item(index, self.seed)
        proxy = self.proxies[index % len(self.proxies)]
        requested_at, version, step = time.time(), self.version(), self.step()
        tids = _tids(self.life, index, attempt, self.group_size)
        run = self._episode if self.multi_turn else self._complete
        futures = [self._pool.submit(run, proxy, tid, item, _seed(self.seed, index, j, attempt))
                   for j, tid in enumerate(tids)]
        finished: set[str] = set()
        try:
            group = self._score_and_read(index, item, proxy, tids, [f.result() for f in futures], finished,
                                         requested_at, version, step)
            group.attempt = attempt
            return group
        except BaseException as exc:
            wait(futures)
            for tid in tids:  # the proxy holds open trajectories until finished: close the group's, marked dropped
                if tid not in finished:
                    try:
                        _http(proxy, "POST", f"/syncd/trajectories/{tid}/finish",
                              {"metadata": {"dropped": f"{type(exc).__name__}: {exc}"[:500]}}, timeout_s=30)
                    except ProxyError:
                        pass
            raise

    def _score_and_read(self, index, item, proxy, tids, outs, finished, requested_at, version, step) -> Group:
        rewards, extra = [], []
        for tid, out in zip(tids, outs):
            ch = out["choices"][0]
            more = {"sandbox": out["episode"]["sandbox"]} if (out.get("episode") or {}).get("sandbox") else {}
            record = episodes.open_record(proxy, tid, more, http=_http, error=ProxyError,
                                          timeout_s=self.request_timeout_s) if self.with_record else None
            sample = Sample(item, ch.get("text") or "", ch.get("finish_reason"),
                            int((out.get("usage") or {}).get("completion_tokens") or 0), step, record,
                            out.get("episode"))
            try:
                got = self.reward(sample)
                r, info = (float(got[0]), got[1]) if isinstance(got, tuple) else (float(got), None)
            except Exception as exc:  # noqa: BLE001 -- a reward function's failure is the group's
                raise _Failed("reward", f"item {index}: the reward raised {type(exc).__name__}: {exc}") from exc
            if r != r or r in (float("inf"), float("-inf")):
                raise _Failed("reward", f"item {index}: the reward returned {r}")
            rewards.append(r)
            extra.append({**more, **({"turns": out["turns"]} if "turns" in out else {}),
                          **({"reward_info": info} if info else {})})
        ids = []
        for j, (tid, r) in enumerate(zip(tids, rewards)):
            meta = {"task": self.task.name, "item": index, "sample": j, "reward": r, "prompt": item.prompt,
                    "requested_version": version, "step": step, **extra[j]}
            status, reply = _http(proxy, "POST", f"/syncd/trajectories/{tid}/finish", {"metadata": meta},
                                  timeout_s=self.request_timeout_s)
            finished.add(tid)
            if status != 200 or not isinstance(reply, dict) or not reply.get("written") \
                    or reply.get("status") != "complete":
                raise _Failed("record", f"trajectory {tid}: the proxy did not write a complete record: "
                                        f"HTTP {status} {reply}")
            ids.append(_ids_of(reply, self.run_id))
            if j == 0:
                self.buffer.record_written(index, ids[0][0])
        rollouts = self.reader.read(ids)
        counted = [int((out.get("usage") or {}).get("completion_tokens") or -1) for out in outs]
        return _make_group(index, item, ids, rewards, rollouts, counted, version, requested_at, time.time(),
                           multi_turn=self.multi_turn)

    # ------------------------------------------------------------------------------------ after a restart

    def close_open(self, entry: dict, reason: str = "the trainer restarted") -> None:
        """Finish an earlier life's trajectories that the proxy may still hold open, marked dropped (best effort)."""
        for tid in entry.get("trajectories") or []:
            try:
                _http(str(entry.get("proxy")), "POST", f"/syncd/trajectories/{tid}/finish",
                      {"metadata": {"dropped": reason}}, timeout_s=10)
            except (ProxyError, ValueError):
                pass

def _ids_of(reply: dict, run_id: str) -> tuple[str, str]:
    """``(sandbox_id, trajectory_id)`` of a written record, from the key the proxy answered."""
    key = str(reply.get("key") or "")
    parts = key.split("/")
    if len(parts) < 4 or parts[-3] != "trajectories" or not key.endswith(".json") or f"/{run_id}/" not in f"/{key}":
        raise _Failed("record", f"the proxy wrote the record to {key!r}, not under run {run_id}'s trajectories")
    return parts[-2], str(reply.get("trajectory_id") or parts[-1][:-5])
