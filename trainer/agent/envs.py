"""Environments of the shipped agent tasks (:class:`syncd.trainer.agent.episode.Environment`), each over its own
sandbox (``syncd.trainer.agent.sandbox``), and the tool-call syntax read from an answer's text.

* :class:`RepoEnv` -- a task of :mod:`syncd.trainer.agent.repos` (bugfix, detect): tools ``bash`` (a command in
  the working copy), ``read_file``, ``write_file`` (the host writes between commands: no link followed, no path
  out of the working copy). Calls: the response's ``tool_calls`` where the frontend parsed them, else
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks in the text (:func:`parse_tool_calls`).
  The final state is graded by the task's verifier on the grader's copy (:meth:`RepoEnv.grade`).
* :class:`LookupEnv` -- the multi-turn task a tiny model learns on two cores: the answer (a letter) exists only in
  the sandbox's ``secret.txt``; the first turn is the query, passed to the ``lookup`` tool (which reads the file in
  the sandbox), the second the answer. It is scored outside the sandbox against the item's target.

Thread-safety: an environment belongs to one episode.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field

from syncd.trainer.agent.episode import Call, ToolRun
from syncd.trainer.agent.grader import grade_snapshot
from syncd.trainer.agent.sandbox import Sandbox, SandboxError, ToolResult

__all__ = ["RepoEnv", "LookupEnv", "parse_tool_calls", "REPO_TOOLS", "LOOKUP_TOOLS", "tool_run"]

_BLOCK = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)
MAX_CALLS_PER_TURN = 8


def _fn(name: str, description: str, **props) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": {k: {"type": "string", "description": d} for k, d in props.items()},
        "required": sorted(props)}}}


REPO_TOOLS = [_fn("bash", "Run a shell command in the repository (no network).", command="the command"),
              _fn("read_file", "Read a file of the repository.", path="its path"),
              _fn("write_file", "Write a file of the repository.", path="its path", content="the new content")]
LOOKUP_TOOLS = [_fn("lookup", "Look the answer up.", query="what to look up")]


def parse_tool_calls(message: dict, turn: int) -> list[Call]:
    """The calls of an assistant ``message``: its ``tool_calls`` (OpenAI format), else ``<tool_call>`` blocks of
    its text; at most ``MAX_CALLS_PER_TURN``; malformed ones are skipped."""
    out = []
    for j, tc in enumerate(message.get("tool_calls") or []):
        fn = tc.get("function") if isinstance(tc, dict) and isinstance(tc.get("function"), dict) else {}
        if isinstance(fn.get("name"), str) and fn["name"]:
            args = fn.get("arguments")
            out.append(Call(str(tc.get("id") or f"call-{turn}-{j}"), fn["name"],
                            args if isinstance(args, str) else json.dumps(args or {})))
    if not out:
        for j, m in enumerate(_BLOCK.finditer(message.get("content") or "")):
            try:
                doc = json.loads(m.group(1))
            except ValueError:
                continue
            if isinstance(doc, dict) and isinstance(doc.get("name"), str) and doc["name"]:
                args = doc.get("arguments")
                out.append(Call(f"call-{turn}-{j}", doc["name"], args if isinstance(args, str) else json.dumps(args)))
    return out[:MAX_CALLS_PER_TURN]


def tool_run(r: ToolResult) -> ToolRun:
    """A sandbox command's result as a tool's."""
    status = "timeout" if r.killed == "timeout" else "killed" if r.killed else "ok" if r.exit_code == 0 else "error"
    return ToolRun(r.text(), status, r.exit_code, r.stdout_bytes + r.stderr_bytes, r.truncated)


@dataclass
class RepoEnv:
    """A repository task in its sandbox (module docstring)."""

    task: object
    sandbox: Sandbox
    system: str = ("You fix and find bugs in small Python repositories. Call a tool as <tool_call>{\"name\": ..., "
                   "\"arguments\": {...}}</tool_call>.")
    log: list = field(default_factory=list)

    def messages(self) -> list[dict]:
        return [{"role": "system", "content": self.system}, {"role": "user", "content": self.task.prompt}]

    def tools(self) -> list[dict]:
        return REPO_TOOLS

    def calls(self, turn: int, message: dict) -> list[Call]:
        return parse_tool_calls(message, turn)

    def run(self, call: Call) -> ToolRun:
        a = call.parsed()
        if call.name == "bash" and isinstance(a.get("command"), str):
            return tool_run(self.sandbox.run(a["command"]))
        if call.name == "read_file" and isinstance(a.get("path"), str):
            return tool_run(self.sandbox.run(f"cat -- {shlex.quote(a['path'])}"))
        if call.name == "write_file" and isinstance(a.get("path"), str) and isinstance(a.get("content"), str):
            try:
                self.sandbox.write_files({a["path"]: a["content"]})
            except (SandboxError, OSError) as exc:
                return ToolRun(f"cannot write {a['path']}: {exc}", "error")
            return ToolRun(f"wrote {len(a['content'].encode())} bytes to {a['path']}")
        return ToolRun(f"unknown tool or bad arguments: {call.name} {call.arguments[:200]}", "refused")

    def grade(self, answer: str):
        """The task's verifier on the grader's copy of the final state (or on the answer, for detect)."""
        return grade_snapshot(self.sandbox, self.task, answer)


@dataclass
class LookupEnv:
    """The lookup task in its sandbox (module docstring): ``secret.txt`` holds the answer."""

    prompt: str
    sandbox: Sandbox
    answer_of_tool: str | None = None  # set: the tool answers this instead of reading the file (an ablation)

    def messages(self) -> list[dict]:
        return [{"role": "user", "content": self.prompt}]

    def tools(self) -> list[dict]:
        return LOOKUP_TOOLS

    def calls(self, turn: int, message: dict) -> list[Call]:
        if turn > 0:
            return []
        return [Call(f"call-{turn}-0", "lookup", json.dumps({"query": message.get("content") or ""}))]

    def run(self, call: Call) -> ToolRun:
        if self.answer_of_tool is not None:
            return ToolRun(self.answer_of_tool, "ok", 0, len(self.answer_of_tool))
        return tool_run(self.sandbox.run("cat secret.txt"))
