"""Tasks for the thin trainer: prompts, how long an answer is, and a verifiable reward.

A :class:`Task` makes its items deterministically (:meth:`Task.item` of an index and a seed) and scores a
completion through its reward function. The reward interface is one callable, :data:`RewardFn`: it gets a
:class:`Sample` (the item, the completion text the sandbox received -- the last answer of a multi-turn episode --,
its finish reason and token count, the trainer step the rollout was requested at, for rewards with schedules, and
the trajectory record as the proxy holds it before the reward is written into it, with every turn and tool call)
and returns a float, or ``(float, info)`` with a JSON ``info`` recorded with the trajectory
(``metadata["reward_info"]``). The shipped tasks' rewards are in [0, 1]; group-normalised advantages make any
other scale work too (``syncd.trainer.rewards.swe.SWECheckReward`` is the SWE-check reward behind the same
interface; ``syncd.trainer.rewards.record.RecordReward`` the length penalty, latency phase and cheating check
on the record).

A task named ``NAME:OPTIONS`` (:func:`get_task`) takes options (comma-separated, parsed by
``syncd.trainer.rewards.record.parse_options``): the reward stack on the record (``cheating``/``nocheating``,
``length=...``, ``latency=...``) and the task's own (``turns=N``, ``quarantine=PATH`` for the agent tasks).
The multi-turn agent tasks with tools in sandboxes (``lookup``, ``bugfix``, ``detect``) are
:mod:`syncd.trainer.rl.agent_tasks`; a task with ``multi_turn`` set runs :meth:`episode` instead of one
completion.

Shipped tasks (a tiny random-init model over the 320-token byte-level vocabulary of ``make_tiny``; the figures
are measured by ``python -m bench.rl_loop`` and ``docs/trainer.md``):

* ``repeat`` (default): the prompt is one letter of ``abcd`` and a colon (``"c:"``); the answer is that letter
  ``length`` times. Reward: half the share of answer characters in the alphabet, half the share equal to the
  prompt's letter (a random model scores about 0.01; the in-alphabet half is learnt first, then the letter).
* ``letters``: the prompt is three lowercase letters and a colon; reward: the share of answer characters that
  are lowercase ASCII letters (a random model: about 0.1; learnt in a few dozen steps).
* ``reverse``: the prompt is ``length`` letters of ``abcd`` and a colon; the answer is the prompt reversed,
  scored like ``repeat`` (harder: the model must attend to every prompt position).
* ``mix``: two tasks in one prompt sequence, alternating by index: even items are ``repeat`` (``length`` tokens),
  odd ones ``reverse`` with 4x the answer length, so one task generates about 4x faster than the other. Each item's
  ``meta`` names its task (``task``: the buffer policy's stratum) and its answer length (``max_tokens``,
  :meth:`Task.max_tokens_for`).

Answers are scored over exactly ``length`` characters (missing ones count as wrong; EOS is ignored by the
engines so every answer has ``length`` tokens). Pure Python; thread-safe.
"""

from __future__ import annotations

import importlib
import random
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["TaskItem", "Sample", "RewardFn", "Task", "MixTask", "TASKS", "get_task", "task_names", "load_reward",
           "DEFAULT_TASK"]

DEFAULT_TASK = "repeat"
ALPHABET = "abcd"


@dataclass(frozen=True)
class TaskItem:
    """One prompt of a task: ``index`` in the task's sequence, the ``prompt`` text, the ``target`` answer where
    one exists, and ``meta`` (JSON-able; recorded with every trajectory of the item)."""

    index: int
    prompt: str
    target: str | None = None
    meta: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Sample:
    """What a reward function sees: one ``completion`` of ``item`` as the sandbox received it (a multi-turn
    episode's last answer), the tokens every turn generated, the trainer ``step``, the trajectory ``record``
    (``syncd.records.trajectory``; None where the worker did not fetch it: single-turn tasks whose reward does
    not declare ``needs_record``) and the ``episode`` (a multi-turn task's outcome, e.g. its grade; None for
    single-turn tasks)."""

    item: TaskItem
    completion: str
    finish_reason: str | None = None
    completion_tokens: int = 0
    step: int = 0
    record: dict | None = None
    episode: dict | None = None


RewardFn = Callable[[Sample], "float | tuple[float, dict]"]


def _match_score(text: str, target: str, alphabet: str) -> float:
    n = len(target)
    text = text[:n]
    inside = sum(ch in alphabet for ch in text) / n
    exact = sum(a == b for a, b in zip(text, target)) / n
    return 0.5 * inside + 0.5 * exact


class Task:
    """A task: ``name``, the answer ``length`` in tokens (``max_tokens`` of each request), items and a reward.
    Subclasses implement :meth:`make` and :meth:`score`; :meth:`reward` is the :data:`RewardFn`. ``multi_turn``
    tasks implement ``episode`` (:mod:`syncd.trainer.rl.agent_tasks`)."""

    name = "task"
    ignore_eos = True
    multi_turn = False

    def __init__(self, length: int = 8):
        if length < 1:
            raise ValueError(f"a task answer needs at least one token, got length={length}")
        self.length = length

    @property
    def max_tokens(self) -> int:
        return self.length

    def max_tokens_for(self, item: TaskItem) -> int:
        """The answer length of ``item`` (``max_tokens`` of its requests): :attr:`max_tokens` unless the task
        varies it per item."""
        return self.max_tokens

    def item(self, index: int, seed: int = 0) -> TaskItem:
        """Item ``index`` of the sequence made from ``seed`` (the same arguments give the same item)."""
        return self.make(index, random.Random(f"{self.name}:{seed}:{index}"))

    def make(self, index: int, rng: random.Random) -> TaskItem:
        raise NotImplementedError

    def score(self, item: TaskItem, completion: str) -> float:
        raise NotImplementedError

    def reward(self, sample: Sample) -> float:
        return float(self.score(sample.item, sample.completion))

    def describe(self) -> dict:
        return {"task": self.name, "length": self.length}


class RepeatTask(Task):
    name = "repeat"

    def make(self, index, rng):
        c = rng.choice(ALPHABET)
        return TaskItem(index, f"{c}:", c * self.length)

    def score(self, item, completion):
        return _match_score(completion, item.target, ALPHABET)


class LettersTask(Task):
    name = "letters"

    def make(self, index, rng):
        return TaskItem(index, "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(3)) + ":")

    def score(self, item, completion):
        text = completion[:self.length]
        return sum("a" <= ch <= "z" for ch in text) / self.length


class ReverseTask(Task):
    name = "reverse"

    def make(self, index, rng):
        s = "".join(rng.choice(ALPHABET) for _ in range(self.length))
        return TaskItem(index, f"{s}:", s[::-1])

    def score(self, item, completion):
        return _match_score(completion, item.target, ALPHABET)


class MixTask(Task):
    """``repeat`` and a 4x longer ``reverse``, alternating by index (module docstring)."""

    name = "mix"
    SLOWER = 4

    def make(self, index, rng):
        task, n = ("repeat", self.length) if index % 2 == 0 else ("reverse", self.SLOWER * self.length)
        item = (RepeatTask if task == "repeat" else ReverseTask)(n).make(index, rng)
        return TaskItem(index, item.prompt, item.target, {"task": task, "max_tokens": n})

    @property
    def max_tokens(self) -> int:
        return self.SLOWER * self.length

    def max_tokens_for(self, item):
        n = item.meta.get("max_tokens")
        return n if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= self.max_tokens else self.length

    def score(self, item, completion):
        return _match_score(completion, item.target, ALPHABET)


TASKS: dict[str, type[Task]] = {t.name: t for t in (RepeatTask, LettersTask, ReverseTask, MixTask)}


def _agent_tasks() -> dict[str, type]:
    from syncd.trainer.rl.agent_tasks import AGENT_TASKS

    return AGENT_TASKS


def task_names() -> list[str]:
    return sorted([*TASKS, *_agent_tasks()])


def get_task(name: str, **kwargs) -> Task:
    """The shipped task ``NAME`` or ``NAME:OPTIONS`` (module docstring); ValueError naming the choices for
    another name, or the bad option."""
    from syncd.trainer.rewards.record import RecordReward, parse_options
    from syncd.trainer.rewards.exploits import agent_detectors
    from syncd.trainer.rewards.cheating import CheatingCheck

    base, _, options = name.partition(":")
    agent = _agent_tasks()
    cls = TASKS.get(base) or agent.get(base)
    if cls is None:
        raise ValueError(f"unknown task {base!r}; choose one of {', '.join(sorted(TASKS))} (multi-turn, with tools: "
                         f"{', '.join(sorted(agent))})")
    opts = parse_options(options, cheating_default=base in agent)
    if opts["task"] and base not in agent:
        raise ValueError(f"task {base!r} takes no options {sorted(opts['task'])}")
    task = cls(**kwargs, **opts["task"]) if base in agent else cls(**kwargs)
    if base in agent:
        task.configure(opts)  # the agent task builds its reward stack (SWECheckReward's phases for detect)
    elif opts["cheating"] or opts["length_penalty"] or opts["two_phase"]:
        task.reward = RecordReward(task.reward, cheating=CheatingCheck(agent_detectors()) if opts["cheating"]
                                   else None, length_penalty=opts["length_penalty"], two_phase=opts["two_phase"])
    return task


def load_reward(spec: str) -> RewardFn:
    """The reward function named ``module:attribute`` (a callable taking a :class:`Sample`; a class or factory
    that takes no arguments is called once to make it). ValueError when it cannot be loaded."""
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ValueError(f"a reward is named MODULE:ATTRIBUTE, got {spec!r}")
    try:
        obj = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load reward {spec!r}: {exc}") from None
    if isinstance(obj, type):
        obj = obj()
    if not callable(obj):
        raise ValueError(f"reward {spec!r} is not callable")
    return obj
