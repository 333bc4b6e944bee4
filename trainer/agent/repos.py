"""The shipped agent task family: tiny Python repositories generated from templates, with one injected bug.

:func:`make_task` builds task ``index`` of a ``seed`` deterministically: three functions from :data:`FUNCTIONS`
in one module ``pkg/<name>.py``, one of them with a bug from its template (a one-line mutation), and visible
tests ``tests/test_<name>.py`` (plain ``assert`` s run with ``python3 tests/test_<name>.py``; one of them shows
the bug). Two kinds:

* ``bugfix``: fix the bug. The verifier (``syncd.trainer.agent.grader.HiddenTests``) calls every function of the
  final module on hidden inputs (at least three that expose the bug, and some for each function, so breaking
  another function fails too) and compares with the outputs of the correct module, outside the sandbox; the
  reference solution is the correct module.
* ``detect``: report the bug as a line ``BUG <path>:<line>``; the verifier
  (``syncd.trainer.agent.grader.ReportedFindings``) scores the findings against the injected bug with the SWE-check
  reward (``syncd.trainer.rewards.SWECheckReward``); the reference report names the bug's line.

A :class:`RepoTask` holds what the sandbox gets (``files``: visible only) apart from what only the grader holds
(``reference``, ``hidden``, ``bug``). Expected outputs are computed by running the templates' own code (trusted)
in this process. Pure; thread-safe.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

__all__ = ["FUNCTIONS", "KINDS", "RepoTask", "make_task", "run_source", "Case"]

KINDS = ("bugfix", "detect")
MODULE_NAMES = ("utils", "helpers", "core", "mathx", "textops", "listops")


def _ints(rng, n, lo=-20, hi=20):
    return [rng.randint(lo, hi) for _ in range(n)]


def _word(rng, n=None):
    return "".join(rng.choice("aAbBeEiIoOuUxyzXYZ ") for _ in range(n or rng.randint(1, 9)))


def _pal(rng):
    half = "".join(rng.choice("abcAB1") for _ in range(rng.randint(1, 4)))
    return rng.choice([half + half[::-1], half + "x" + half[::-1], half + "yz"])


#: name -> (correct source, [(line as written, the bug's line, kind)], argument generator)
FUNCTIONS: dict[str, tuple[str, list[tuple[str, str, str]], object]] = {
    "clamp": ("def clamp(x, lo, hi):\n    if x < lo:\n        return lo\n    if x > hi:\n        return hi\n"
              "    return x\n",
              [("        return hi\n", "        return lo\n", "wrong value"),
               ("    if x > hi:\n", "    if x > lo:\n", "wrong comparison")],
              lambda rng: (lambda lo: [rng.randint(-30, 30), lo, lo + rng.randint(1, 15)])(rng.randint(-10, 10))),
    "mean": ("def mean(xs):\n    total = sum(xs)\n    return total / len(xs)\n",
             [("    return total / len(xs)\n", "    return total // len(xs)\n", "integer division")],
             lambda rng: [_ints(rng, rng.randint(2, 6))]),
    "count_vowels": ("def count_vowels(s):\n    return sum(1 for c in s.lower() if c in \"aeiou\")\n",
                     [("    return sum(1 for c in s.lower() if c in \"aeiou\")\n",
                       "    return sum(1 for c in s if c in \"aeiou\")\n", "case")],
                     lambda rng: [_word(rng)]),
    "is_palindrome": ("def is_palindrome(s):\n    t = [c.lower() for c in s if c.isalnum()]\n    return t == t[::-1]\n",
                      [("    t = [c.lower() for c in s if c.isalnum()]\n", "    t = [c for c in s if c.isalnum()]\n",
                        "case")],
                      lambda rng: [rng.choice([_pal(rng), _pal(rng).capitalize(), _pal(rng).upper()[:-1] + "a"])]),
    "running_max": ("def running_max(xs):\n    best = xs[0]\n    out = []\n    for x in xs:\n"
                    "        best = max(best, x)\n        out.append(best)\n    return out\n",
                    [("    best = xs[0]\n", "    best = 0\n", "wrong initial value")],
                    lambda rng: [_ints(rng, rng.randint(1, 6), -30, 10)]),
    "digit_sum": ("def digit_sum(n):\n    return sum(int(d) for d in str(abs(n)))\n",
                  [("    return sum(int(d) for d in str(abs(n)))\n", "    return sum(int(d) for d in str(n))\n",
                    "negative input")],
                  lambda rng: [rng.randint(-999, 999)]),
    "second_largest": ("def second_largest(xs):\n    values = sorted(set(xs))\n    return values[-2]\n",
                       [("    values = sorted(set(xs))\n", "    values = sorted(xs)\n", "duplicates")],
                       lambda rng: [(lambda xs: xs + [max(xs)] * rng.randint(0, 2))(_ints(rng, rng.randint(2, 5)))]),
    "fizzbuzz": ("def fizzbuzz(n):\n    if n % 15 == 0:\n        return \"FizzBuzz\"\n    if n % 3 == 0:\n"
                 "        return \"Fizz\"\n    if n % 5 == 0:\n        return \"Buzz\"\n    return str(n)\n",
                 [("    if n % 15 == 0:\n", "    if n % 10 == 0:\n", "wrong modulus")],
                 lambda rng: [rng.randint(1, 60)]),
}


@dataclass(frozen=True)
class Case:
    """One call of the hidden or visible tests: ``function(*args)`` and its correct output (an error's class name
    under ``{"error": ...}`` when the correct code raises)."""

    function: str
    args: list
    expected: object


@dataclass(frozen=True)
class RepoTask:
    """One task: ``id``, ``kind`` (:data:`KINDS`), ``prompt`` (the instruction), ``files`` (the visible working
    copy), ``module`` (its path), ``reference`` (bugfix: the fixed files; detect: the reference report),
    ``hidden`` (bugfix: the grader's :class:`Case` s), ``visible`` (the visible tests' cases) and ``bug``
    (``{"file", "line", "function", "kind"}``, the ground truth)."""

    id: str
    kind: str
    prompt: str
    files: dict
    module: str
    reference: object
    hidden: tuple = ()
    visible: tuple = ()
    bug: dict = field(default_factory=dict)

    def meta(self) -> dict:
        """What a task item records with its trajectories (JSON): no hidden case, no reference."""
        return {"task_id": self.id, "kind": self.kind, "module": self.module, "bugs": [self.bug]}


def run_source(source: str, function: str, args: list):
    """``function(*args)`` of trusted template ``source`` (JSON-able output, or ``{"error": class name}``)."""
    ns: dict = {}
    exec(compile(source, "<template>", "exec"), ns)  # noqa: S102 -- the templates above, never a sandbox's code
    try:
        return json.loads(json.dumps(ns[function](*json.loads(json.dumps(args)))))
    except Exception as exc:  # noqa: BLE001 -- an error is an output like any other
        return {"error": type(exc).__name__}


def _cases(rng, name: str, correct: str, buggy: str, n: int, exposing: int) -> list[Case]:
    """``n`` cases of ``name`` (at least ``exposing`` on which ``buggy`` differs, when it is the buggy one)."""
    gen = FUNCTIONS[name][2]
    out, exposed, tries = [], 0, 0
    while len(out) < n and tries < 2000:
        tries += 1
        args = gen(rng)
        if any(c.args == args for c in out):
            continue
        want = run_source(correct, name, args)
        differs = correct != buggy and run_source(buggy, name, args) != want
        if differs and exposed < exposing:
            exposed += 1
        elif len(out) >= n - (exposing - exposed):
            continue
        out.append(Case(name, args, want))
    return out


def _test_file(module: str, cases: list[Case]) -> str:
    lines = [f"import sys\nsys.path.insert(0, '.')\nfrom pkg.{module} import *\n\n"]
    for i, c in enumerate(cases):
        call = f"{c.function}({', '.join(repr(a) for a in c.args)})"
        lines.append(f"def test_{c.function}_{i}():\n    assert {call} == {c.expected!r}\n\n")
    lines.append("\nif __name__ == '__main__':\n    failed = 0\n"
                 "    for k, f in sorted(globals().items()):\n        if k.startswith('test_'):\n"
                 "            try:\n                f()\n            except Exception as exc:\n"
                 "                failed += 1\n                print('FAIL', k, type(exc).__name__, exc)\n"
                 "    print('failed', failed)\n    sys.exit(1 if failed else 0)\n")
    return "".join(lines)


def make_task(index: int, seed: int = 0, kind: str = "bugfix") -> RepoTask:
    """Task ``index`` of the family made from ``seed`` (the same arguments give the same task)."""
    if kind not in KINDS:
        raise ValueError(f"unknown task kind {kind!r}; choose one of {', '.join(KINDS)}")
    rng = random.Random(f"repos:{seed}:{index}")
    module = rng.choice(MODULE_NAMES)
    names = rng.sample(sorted(FUNCTIONS), 3)
    buggy_name = rng.choice(names)
    old, new, bug_kind = rng.choice(FUNCTIONS[buggy_name][1])
    correct_src = "\n\n".join(FUNCTIONS[n][0] for n in names)
    buggy_src = correct_src.replace(old, new, 1)
    path = f"pkg/{module}.py"
    line = correct_src[:correct_src.index(old)].count("\n") + 1
    visible, hidden = [], []
    for n in names:
        correct, buggy = FUNCTIONS[n][0], FUNCTIONS[n][0].replace(old, new, 1) if n == buggy_name else FUNCTIONS[n][0]
        visible += _cases(rng, n, correct, buggy, 2, 1 if n == buggy_name else 0)
        hidden += _cases(rng, n, correct, buggy, 8 if n == buggy_name else 4, 4 if n == buggy_name else 0)
    files = {"pkg/__init__.py": "", path: buggy_src, f"tests/test_{module}.py": _test_file(module, visible)}
    tid = f"{kind}-{seed}-{index}"
    bug = {"file": path, "line": line, "function": buggy_name, "kind": bug_kind}
    if kind == "bugfix":
        files["README.md"] = (f"# {module}\n\nA test in tests/test_{module}.py fails: there is a bug in {path}. "
                              f"Fix it. Run the tests with `python3 tests/test_{module}.py`.\n")
        prompt = f"Fix the bug in {path} so that `python3 tests/test_{module}.py` passes."
        return RepoTask(tid, kind, prompt, files, path, {path: correct_src}, tuple(hidden), tuple(visible), bug)
    files["README.md"] = f"# {module}\n\nOne function of {path} has a bug.\n"
    prompt = f"Find the bug in {path}. Answer with one line `BUG {path}:<line>`."
    return RepoTask(tid, kind, prompt, files, path, f"BUG {path}:{line}", (), tuple(visible), bug)
