"""The multi-turn agent tasks of the thin trainer: tools in a sandbox per trajectory, graded outside it.

Each is a :class:`syncd.trainer.rl.tasks.Task` with ``multi_turn`` set: the rollout workers run
:meth:`AgentTask.episode` for each sample -- a fresh sandbox (``syncd.trainer.agent.sandbox``), the tool-execution
loop (``syncd.trainer.agent.episode``: chat completions with tools through the proxy, the tool calls posted to the
trajectory record), the grade of the final state on the grader's copy, the sandbox closed -- and score the
:class:`~syncd.trainer.rl.tasks.Sample` (its record, its episode) with the task's reward stack
(``syncd.trainer.rewards.record.RecordReward``: cheating detection on by default, ``--task NAME:OPTIONS`` for
the length penalty and the latency phase).

* ``lookup`` (the task a tiny model learns on two cores): the answer is a letter of ``abcd`` that only the
  sandbox's ``secret.txt`` holds; turn 1 is the query, passed to the ``lookup`` tool, turn 2 the answer
  (``length`` tokens). Reward: the share of the answer's ``length`` characters equal to the letter (a policy that
  does not read the tool's output scores at most 0.25 on average). ``lookup:targets=balanced``: the letters of
  items ``4k .. 4k+3`` are a permutation of ``abcd`` (drawn from the seed and ``k``) instead of independent
  draws -- stratified targets: each letter is the answer equally often in every block of consecutive items (a
  step's groups), so the part of the step's gradient that favours one letter whatever the tool says cancels and
  what is left is the reading of the tool's output. Nothing of it is visible to the policy (the prompt and the
  sandbox are those of a random item), and a policy that ignores the tool still scores exactly 0.25 at best.
* ``bugfix``, ``detect`` (``syncd.trainer.agent.repos``): tools ``bash``, ``read_file``, ``write_file``; up to
  ``turns`` turns (default 8). ``bugfix`` scores 1 when the hidden tests pass on the final state (else 0);
  ``detect`` scores the final report with :class:`syncd.trainer.rewards.SWECheckReward` (its length penalty and
  latency phase inside it). ``quarantine=PATH`` (a ``syncd tasks qa --out`` report) skips the quarantined tasks:
  item ``i`` is the first task from ``i`` on that QA kept.

The curation filter (``syncd.trainer.rl.curation.CuratedTask``) wraps these like any task. Thread-safety: items
and rewards are pure; each episode owns its sandbox.
"""

from __future__ import annotations

import itertools
import json
import random

from syncd.trainer.rl.tasks import Task, TaskItem

__all__ = ["AgentTask", "LookupTask", "ScriptedLookup", "RepoAgentTask", "AGENT_TASKS", "LOOKUP_ALPHABET"]

LOOKUP_ALPHABET = "abcd"


class AgentTask(Task):
    """A multi-turn task (module docstring). ``turns``: chat requests per episode at most."""

    multi_turn = True
    ignore_eos = False
    default_turns = 8

    def __init__(self, length: int = 8, turns: int | str | None = None, **options):
        super().__init__(length)
        self.turns = int(turns) if turns is not None else self.default_turns
        if self.turns < 1:
            raise ValueError(f"turns must be >= 1, got {turns}")
        self.options = dict(options)
        self.cheating = None
        self._stack = None

    def configure(self, opts: dict) -> None:
        """Build the reward stack from ``parse_options``' result."""
        from syncd.trainer.rewards import CheatingCheck, RecordReward, agent_detectors

        self.cheating = CheatingCheck(agent_detectors()) if opts["cheating"] else None
        self._stack = RecordReward(self.score_sample, cheating=self.cheating,
                                   length_penalty=opts["length_penalty"], two_phase=opts["two_phase"])

    @property
    def needs_record(self) -> bool:
        return True

    def reward(self, sample):
        if self._stack is None:
            self.configure({"cheating": True, "length_penalty": None, "two_phase": None})
        return self._stack(sample)

    def score(self, item, completion):
        raise NotImplementedError

    def score_sample(self, sample) -> float:
        return float(self.score(sample.item, sample.completion))

    def describe(self) -> dict:
        return {**super().describe(), "turns": self.turns}

    def episode(self, item: TaskItem, chat, post_calls) -> tuple[object, dict]:
        """Run one episode of ``item``: ``(the agent.episode.Episode, the episode's outcome for the reward)``."""
        raise NotImplementedError


class LookupTask(AgentTask):
    name = "lookup"
    default_turns = 2
    target_modes = ("random", "balanced")

    def __init__(self, length: int = 4, turns=None, targets: str = "random", **options):
        super().__init__(length, turns, **options)
        if targets not in self.target_modes:
            raise ValueError(f"lookup targets must be one of {', '.join(self.target_modes)}, got {targets!r}")
        self.targets = targets

    def item(self, index: int, seed: int = 0) -> TaskItem:
        """Item ``index``; with ``targets="balanced"`` its letter is place ``index % 4`` of block ``index // 4``'s
        permutation of the alphabet (module docstring)."""
        if self.targets == "random":
            return super().item(index, seed)
        n = len(LOOKUP_ALPHABET)
        letters = list(LOOKUP_ALPHABET)
        random.Random(f"{self.name}:{seed}:block:{index // n}").shuffle(letters)
        return TaskItem(index, "q", letters[index % n], {"kind": "lookup"})

    def describe(self) -> dict:
        return {**super().describe(), "targets": self.targets}

    @property
    def max_tokens(self) -> int:
        return self.length

    def make(self, index, rng):
        return TaskItem(index, "q", rng.choice(LOOKUP_ALPHABET), {"kind": "lookup"})

    def score(self, item, completion):
        return sum(ch == item.target for ch in completion[:self.length]) / self.length

    def episode(self, item, chat, post_calls, *, answer_of_tool: str | None = None):
        from syncd.trainer.agent.envs import LookupEnv
        from syncd.trainer.agent.episode import run_episode
        from syncd.trainer.agent.sandbox import Limits, Sandbox

        with Sandbox.create({"secret.txt": item.target}, limits=Limits(timeout_s=10)) as sb:
            env = LookupEnv(item.prompt, sb, answer_of_tool)
            ep = run_episode(chat, env, max_turns=self.turns, post_calls=post_calls, max_output_chars=64)
            return ep, {"sandbox": sb.describe(), "turns": ep.turns, "tool_calls": len(ep.tool_calls)}


class ScriptedLookup(LookupTask):
    """The lookup task whose first turn calls ``bash`` with a scripted command instead of ``lookup`` -- each episode
    the next of ``commands``, whatever the model wrote: known tool calls (cheating attempts, sandbox escapes, clean
    work) injected through the whole harness (sandbox, proxy, record, reward stack) for tests and benchmarks.
    ``results``: each command's whole output (the model is shown 64 characters)."""

    name = "scripted-lookup"

    def __init__(self, commands, length: int = 4, **options):
        super().__init__(length, **options)
        self.commands, self.results = list(commands), {}
        self._next = itertools.count()

    def episode(self, item, chat, post_calls):
        from syncd.trainer.agent.envs import LookupEnv, tool_run
        from syncd.trainer.agent.episode import Call, run_episode
        from syncd.trainer.agent.sandbox import Limits, Sandbox

        command = self.commands[next(self._next) % len(self.commands)]
        results = self.results

        class Env(LookupEnv):
            def calls(self, turn, message):
                return [Call(f"call-{turn}-0", "bash", json.dumps({"command": command}))] if turn == 0 else []

            def run(self, call):
                r = self.sandbox.run(command)
                results[command] = r.text()
                return tool_run(r)

        with Sandbox.create({"secret.txt": item.target}, limits=Limits(timeout_s=3)) as sb:
            ep = run_episode(chat, Env(item.prompt, sb), max_turns=self.turns, post_calls=post_calls,
                             max_output_chars=64)
            return ep, {"sandbox": sb.describe(), "command": command}


class RepoAgentTask(AgentTask):
    """``bugfix`` or ``detect`` (module docstring)."""

    kind = "bugfix"

    def __init__(self, length: int = 256, turns=None, quarantine: str | None = None, **options):
        super().__init__(length, turns, **options)
        from syncd.trainer.agent.qa import load_quarantine

        self.quarantine = load_quarantine(quarantine) if quarantine else {}
        self._swe = None

    def task_of(self, index: int, seed: int):
        from syncd.trainer.agent.repos import make_task

        for k in range(index, index + 10_000):
            t = make_task(k, seed, self.kind)
            if t.id not in self.quarantine:
                return t
        raise ValueError("every task of the family is quarantined")

    def item(self, index: int, seed: int = 0) -> TaskItem:
        t = self.task_of(index, seed)
        return TaskItem(index, t.prompt, None, {**t.meta(), "seed": seed})

    def make(self, index, rng):  # items come from item(); make is not used
        raise NotImplementedError

    def configure(self, opts: dict) -> None:
        super().configure(opts)
        if self.kind == "detect":
            from syncd.trainer.agent.grader import ReportedFindings
            from syncd.trainer.rewards import SWECheckReward

            rf = ReportedFindings()
            base = rf.reward()
            self._swe = SWECheckReward(parse=base.parse, match=base.match, linearized=base.linearized,
                                       length_penalty=opts["length_penalty"], two_phase=opts["two_phase"])
            from syncd.trainer.rewards import RecordReward

            self._stack = RecordReward(self._swe, cheating=self.cheating)

    def score_sample(self, sample) -> float:
        grade = (sample.episode or {}).get("grade") or {}
        return 1.0 if grade.get("passed") else 0.0

    def episode(self, item, chat, post_calls):
        from syncd.trainer.agent.envs import RepoEnv
        from syncd.trainer.agent.episode import run_episode
        from syncd.trainer.agent.sandbox import Sandbox

        task = self.task_of(item.index, int(item.meta.get("seed", 0)))
        with Sandbox.create(task.files) as sb:
            env = RepoEnv(task, sb)
            ep = run_episode(chat, env, max_turns=self.turns, post_calls=post_calls)
            v = env.grade(ep.answer)
            return ep, {"sandbox": sb.describe(), "grade": {"passed": v.passed, "score": v.score,
                                                            "detail": v.detail}}


class BugfixTask(RepoAgentTask):
    name = "bugfix"
    kind = "bugfix"


class DetectTask(RepoAgentTask):
    name = "detect"
    kind = "detect"


AGENT_TASKS: dict[str, type[AgentTask]] = {t.name: t for t in (LookupTask, BugfixTask, DetectTask)}

