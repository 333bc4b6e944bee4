"""Tasks for the thin trainer: prompts, how long an answer is, and a verifiable reward.

A :class:`Task` makes its items deterministically (:meth:`Task.item` of an index and a seed) and scores a
completion through its reward function. The reward interface is one callable, :data:`RewardFn`: it gets a
:class:`Sample` (the item, the completion text the sandbox received, its finish reason and token count, and
the trainer step the rollout was requested at, for rewards with schedules) and returns a float. The shipped
tasks' rewards are in [0, 1]; group-normalised advantages make any other scale work too
(``syncd.trainer.rewards.swe.SWECheckReward`` is the SWE-check reward behind the same interface).

Shipped tasks (a tiny random-init model over the 320-token byte-level vocabulary of ``make_tiny``; the figures
are measured by ``python -m bench.rl_loop`` and ``docs/trainer.md``):

* ``repeat`` (default): the prompt is one letter of ``abcd`` and a colon (``"c:"``); the answer is that letter
  ``length`` times. Reward: half the share of answer characters in the alphabet, half the share equal to the
  prompt's letter (a random model scores about 0.01; the in-alphabet half is learnt first, then the letter).
* ``letters``: the prompt is three lowercase letters and a colon; reward: the share of answer characters that
  are lowercase ASCII letters (a random model: about 0.1; learnt in a few dozen steps).
* ``reverse``: the prompt is ``length`` letters of ``abcd`` and a colon; the answer is the prompt reversed,
  scored like ``repeat`` (harder: the model must attend to every prompt position).

Answers are scored over exactly ``length`` characters (missing ones count as wrong; EOS is ignored by the
engines so every answer has ``length`` tokens). Pure Python; thread-safe.
"""

from __future__ import annotations

import importlib
import random
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["TaskItem", "Sample", "RewardFn", "Task", "TASKS", "get_task", "load_reward", "DEFAULT_TASK"]

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
    """What a reward function sees: one ``completion`` of ``item`` as the sandbox received it."""

    item: TaskItem
    completion: str
    finish_reason: str | None = None
    completion_tokens: int = 0
    step: int = 0


RewardFn = Callable[[Sample], float]


def _match_score(text: str, target: str, alphabet: str) -> float:
    n = len(target)
    text = text[:n]
    inside = sum(ch in alphabet for ch in text) / n
    exact = sum(a == b for a, b in zip(text, target)) / n
    return 0.5 * inside + 0.5 * exact


class Task:
    """A task: ``name``, the answer ``length`` in tokens (``max_tokens`` of each request), items and a reward.
    Subclasses implement :meth:`make` and :meth:`score`; :meth:`reward` is the :data:`RewardFn`."""

    name = "task"
    ignore_eos = True

    def __init__(self, length: int = 8):
        if length < 1:
            raise ValueError(f"a task answer needs at least one token, got length={length}")
        self.length = length

    @property
    def max_tokens(self) -> int:
        return self.length

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


TASKS: dict[str, type[Task]] = {t.name: t for t in (RepeatTask, LettersTask, ReverseTask)}


def get_task(name: str, **kwargs) -> Task:
    """The shipped task ``name``; ValueError naming the choices for another name."""
    try:
        cls = TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; choose one of {', '.join(sorted(TASKS))}") from None
    return cls(**kwargs)


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
