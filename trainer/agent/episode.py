"""The tool-execution loop on the rollout side: one multi-turn trajectory of chat completions with tools.

    ep = run_episode(chat, env, max_turns=4, post_calls=post)

Each turn sends the conversation so far with the environment's tools (the OpenAI tools format) through ``chat``
(one ``/v1/chat/completions`` request of the trajectory through the sandbox proxy; the caller adds the model,
sampling, seed and the trajectory header). The environment reads the tool calls of the answer
(:meth:`Environment.calls`: the response's ``tool_calls`` where the frontend parsed them, else the task's own
syntax in the text); none ends the episode. Otherwise the assistant message is appended with its ``tool_calls``
and its text unchanged (so the chat template renders exactly the tokens the engine generated, and the next
turn's prompt extends this turn's prompt and output), every call runs in the sandbox (:meth:`Environment.run`,
timed), its output is appended as a ``tool`` message, and the calls are posted to the proxy (``post_calls``) so
the trajectory record holds each one with its output and wall time (``syncd.records.trajectory``, version 2).
After ``max_turns`` turns the episode ends whatever the last turn asked for.

A tool that raises is the tool's failure, recorded (``status: "error"``) and shown to the model; the episode goes
on. ``chat`` and ``post_calls`` failures propagate (the caller drops the group). Thread-safety: one episode per
call; the environment is the episode's own.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from syncd.records.trajectory import TOOL_STATUSES

__all__ = ["Call", "ToolRun", "Environment", "Episode", "run_episode", "MAX_ARGUMENT_CHARS"]

MAX_ARGUMENT_CHARS = 64 << 10


@dataclass(frozen=True)
class Call:
    """A tool call: ``id``, the tool ``name`` and its ``arguments`` as the model wrote them (a JSON string)."""

    id: str
    name: str
    arguments: str

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def parsed(self) -> dict:
        """The arguments as a JSON object ({} when they are not one)."""
        try:
            v = json.loads(self.arguments)
        except ValueError:
            return {}
        return v if isinstance(v, dict) else {}


@dataclass
class ToolRun:
    """What a tool gave back: the ``output`` the model sees, how it ended (``status``, ``exit_code``), the bytes it
    wrote and whether ``output`` is cut."""

    output: str
    status: str = "ok"
    exit_code: int | None = None
    output_bytes: int = 0
    truncated: bool = False


class Environment(Protocol):
    """A task's side of an episode: the first messages, the tools (OpenAI format), which calls an answer makes,
    running one, and the final answer."""

    def messages(self) -> list[dict]: ...

    def tools(self) -> list[dict]: ...

    def calls(self, turn: int, message: dict) -> list[Call]: ...

    def run(self, call: Call) -> ToolRun: ...


@dataclass
class Episode:
    """One finished episode: the ``messages`` of the whole conversation, the ``answer`` (the last assistant text),
    the ``turns`` (chat requests), the tool calls as recorded (``tool_calls``), the generated tokens over every
    turn as the responses counted them, and the last turn's finish reason."""

    messages: list[dict]
    answer: str
    turns: int
    tool_calls: list[dict] = field(default_factory=list)
    completion_tokens: int = 0
    finish_reason: str | None = None

    @property
    def tool_time_s(self) -> float:
        return float(sum(c["wall_s"] for c in self.tool_calls))


def _message(resp: dict) -> tuple[dict, str | None, int]:
    ch = (resp.get("choices") or [{}])[0]
    msg = ch.get("message") if isinstance(ch.get("message"), dict) else {}
    usage = resp.get("usage") if isinstance(resp.get("usage"), dict) else {}
    n = usage.get("completion_tokens")
    return msg, ch.get("finish_reason"), n if isinstance(n, int) and not isinstance(n, bool) else 0


def run_episode(chat: Callable[[dict], dict], env: Environment, *, max_turns: int,
                post_calls: Callable[[list[dict]], None] | None = None, max_output_chars: int = 4096) -> Episode:
    """Run one episode (module docstring). ``chat(body)`` gets ``{"messages", "tools"}`` and returns the
    whole chat completion response. A tool's output is shown (and recorded) cut to ``max_output_chars``
    characters, marked ``truncated``: the model's context is bounded, what a command prints is not."""
    if max_turns < 1:
        raise ValueError(f"an episode needs at least one turn, got max_turns={max_turns}")
    messages = list(env.messages())
    tools = env.tools()
    ep = Episode(messages, "", 0)
    for turn in range(max_turns):
        body = {"messages": list(messages), **({"tools": tools} if tools else {})}
        msg, ep.finish_reason, n = _message(chat(body))
        ep.turns += 1
        ep.completion_tokens += n
        text = msg.get("content") if isinstance(msg.get("content"), str) else ""
        ep.answer = text
        calls = env.calls(turn, msg) if turn + 1 < max_turns else []
        if not calls:
            messages.append({"role": "assistant", "content": text})
            break
        messages.append({"role": "assistant", "content": text, "tool_calls": [c.openai() for c in calls]})
        done = []
        for c in calls:
            started = time.time()
            t0 = time.monotonic()
            try:
                r = env.run(c)
            except Exception as exc:  # noqa: BLE001 -- the tool's failure, shown to the model and recorded
                r = ToolRun(f"tool error: {type(exc).__name__}: {exc}", "error")
            wall = time.monotonic() - t0
            status = r.status if r.status in TOOL_STATUSES else "error"
            if len(r.output) > max_output_chars:
                r.output, r.truncated = r.output[:max_output_chars - 20] + "\n[output truncated]", True
            messages.append({"role": "tool", "tool_call_id": c.id, "content": r.output})
            done.append({"turn": turn, "id": c.id, "name": c.name, "arguments": c.arguments[:MAX_ARGUMENT_CHARS],
                         "output": r.output, "started_at": _iso(started), "wall_s": round(wall, 6),
                         "status": status, "exit_code": r.exit_code, "output_bytes": r.output_bytes,
                         "truncated": r.truncated})
        if post_calls is not None:
            post_calls(done)
        ep.tool_calls += done
    ep.messages = messages
    return ep


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e6):06d}Z"
