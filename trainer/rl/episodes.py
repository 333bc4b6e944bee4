"""The multi-turn side of a rollout worker: one agent episode through the sandbox proxy, and the record the reward
sees.

:func:`run_episode` runs a ``multi_turn`` task's episode (:mod:`syncd.trainer.rl.agent_tasks`) as trajectory
``tid`` of the proxy at ``url``: each turn is one ``/v1/chat/completions`` request (the worker's sampling, the
task's ``max_tokens``, a seed per turn made from the sample's), the tool calls it ran are posted to the
trajectory (``POST /syncd/trajectories/<tid>/tool_calls``). It returns what a single completion's response gives
the worker (the last answer as ``choices[0].text``, the finish reason, every turn's generated tokens as
``usage.completion_tokens``) and the episode's outcome (``"episode"``: the sandbox's description, the grade).

:func:`open_record` is the trajectory record as the proxy holds it before it is finished (``GET
/syncd/trajectories/<tid>``), with the metadata the worker will finish it with (the sandbox's description, which
the network detector reads): the record the reward gets, which the store then holds with the reward added.

``http(url, method, path, body, headers, timeout_s) -> (status, reply)`` is the worker's HTTP call; a failure is
a :class:`ProxyError` of the caller's. Thread-safety: one call per episode.
"""

from __future__ import annotations

__all__ = ["run_episode", "open_record", "episodic", "wants_record"]


def episodic(task):
    """The multi-turn task inside ``task`` (through wrappers such as the curation filter's ``.task``), or None."""
    seen = 0
    while task is not None and seen < 8:
        if getattr(type(task), "multi_turn", False) and hasattr(task, "episode"):
            return task
        task, seen = getattr(task, "task", None), seen + 1
    return None


def wants_record(reward) -> bool:
    """Whether ``reward`` (a callable, or a bound method of an object) declares ``needs_record``."""
    return bool(getattr(reward, "needs_record", False) or getattr(getattr(reward, "__self__", None), "needs_record",
                                                                  False))


def run_episode(task, item, *, url: str, tid: str, body: dict, seed: int, http, error, header: str,
                timeout_s: float) -> dict:
    """One episode (module docstring). ``body``: the request's fixed members (model, sampling, max_tokens);
    ``error(msg)``: the exception to raise for a proxy failure."""
    turn = [0]

    def chat(extra: dict) -> dict:
        req = {**body, **extra, "seed": (seed + 7919 * turn[0]) % (1 << 31)}
        turn[0] += 1
        status, out = http(url, "POST", "/v1/chat/completions", req, {header: tid}, timeout_s)
        if status != 200 or not isinstance(out, dict) or not out.get("choices"):
            raise error(f"trajectory {tid}: chat turn {turn[0]}: HTTP {status}: {str(out)[:300]}")
        return out

    def post(calls: list[dict]) -> None:
        status, out = http(url, "POST", f"/syncd/trajectories/{tid}/tool_calls", {"tool_calls": calls}, None,
                           timeout_s)
        if status != 200:
            raise error(f"trajectory {tid}: the proxy refused the tool calls: HTTP {status}: {str(out)[:300]}")

    ep, outcome = task.episode(item, chat, post)
    return {"choices": [{"text": ep.answer, "finish_reason": ep.finish_reason}],
            "usage": {"completion_tokens": ep.completion_tokens}, "episode": outcome, "turns": ep.turns}


def open_record(url: str, tid: str, metadata: dict, *, http, error, timeout_s: float) -> dict:
    """The open record of ``tid`` with ``metadata`` merged in (module docstring)."""
    status, rec = http(url, "GET", f"/syncd/trajectories/{tid}", None, None, timeout_s)
    if status != 200 or not isinstance(rec, dict) or not isinstance(rec.get("turns"), list):
        raise error(f"trajectory {tid}: the proxy did not show its open record: HTTP {status}: {str(rec)[:300]}")
    rec["metadata"] = {**(rec.get("metadata") if isinstance(rec.get("metadata"), dict) else {}), **metadata}
    return rec
