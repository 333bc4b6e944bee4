"""Self-compaction in the sandbox proxy: when an agent nears the context limit, ask it to summarize its working
state and resume it from its own summary (the seed's long-horizon recipe), recorded so that it trains cleanly.

Policy (:class:`CompactionConfig`): a ``/v1/completions`` or ``/v1/chat/completions`` request is compacted when
its prompt plus its ``max_tokens`` would pass ``trigger`` of the context window (``window`` tokens, the engine's
positions). A chat request's prompt is its ``messages`` rendered with the model's chat template
(``syncd.engine.proxy.chat_template``, ``add_generation_prompt``) and tokenised by the proxy; its bound is
``max_completion_tokens`` or ``max_tokens`` (a chat request with neither passes through). A chat with ``tools``
is compacted like any other (the template renders the tools: an agent harness's tool-calling episodes outlive the
window); its answer's message is the text, on which the frontend's tool-call parsing is not run (syncd's workers
register no parser; the client reads the calls from the text, as ``syncd.trainer.agent.envs`` does). A chat whose
``tool_choice`` forces a call (``"required"``, a named function) or whose ``response_format`` constrains the text
passes through: a segment sent as a plain completion would lose the constraint. From there on both endpoints are
one mechanism: the proxy runs the request as segments, each one upstream ``/v1/completions`` request with the
prompt as token ids, recorded as a turn of the trajectory:

1. **generate** -- the context ``C`` (the prompt's token ids) generates up to the budget
   ``floor(trigger * window) - len(C)`` tokens ``O``;
2. **summary** -- ``C + O + summary_prompt`` (just ``C + summary_prompt`` when ``C`` itself leaves no room)
   generates ``summary_tokens`` tokens ``S`` (the model's own
   summary; never shown to the client);
3. **continuation** -- the new context ``C' = C[:keep_prompt] + resume_prompt + S + continue_prompt`` (the task's
   head and the summary's *sampled* ids, never detokenised and tokenised again) generates the next tokens; steps
   2-3 repeat until the request's ``max_tokens`` are made or the model stops (at most ``max_compactions``).

``summary`` selects what replaces the context at step 3, for ablations (``bench.compaction_recall``):
``"model"`` (the default, above), ``"empty"`` (no summary segment; ``S`` is empty) or ``"truncate"`` (no summary
segment; plain truncation: ``C' = C[:keep_prompt]`` and the last ``len(resume_prompt) + summary_tokens +
len(continue_prompt)`` tokens of ``C + O``, a context as long as the model arm's). The ablations record no summary
turns, so their records list no boundaries (``compactions`` is empty); ``nvext.compactions`` counts them all the same.

Every segment is sent to the frontend as token ids (``prompt: [ids]``; a chat body's sampling members are kept,
its chat-only members dropped), so the engine sees exactly the ids the record holds; each turn carries the usual
record (prompt ids, sampled ids, versions, log-probs, the engine request ids that join it to the replay records
with its kept sets and routes) and a ``compaction`` member ``{"request", "segment", "role": "generate" |
"summary" | "continuation", "client_request"?}`` (``client_request``: the client's body, chat or completions); the
trajectory's ``compactions`` member lists the boundaries (``syncd.records.trajectory``). The client gets one
answer in its endpoint's form (a ``text_completion``, or a ``chat.completion`` whose message is the text): the
generate and continuation outputs concatenated (streamed clients get it as one chunk when the request ends),
``usage`` counting those tokens, and ``nvext.compactions``, the number of compactions.

A later request of a compacted trajectory whose prompt text (for chat: the rendered messages) extends what the
client saw (its prompt and the answer) continues from the live context: the new text alone is tokenised and
appended to ``C'`` and what it generated (when the model stopped on a special token the client's text does not
show, e.g. ``<|im_end|>``, and the new text starts with it -- a chat template closing the assistant's message --
it is not appended twice). When the live context and the new text (a tool's long output) would leave no room to
summarize, the live context is compacted first and the new text appended to the continuation. ``n > 1``, prompts
of several texts and prompts too long even to summarize pass through uncompacted, as do chat requests when the
model folder has no chat template.

Errors: a configuration that leaves no room (``trigger * window`` plus the summary prompt and tokens past the
window, a continuation's fixed part filling the budget) raises ValueError at start-up; a context too long to
summarize (new text longer than what a continuation leaves), or ``max_compactions`` used up, fails the request
(HTTP 400, a failed turn saying why). Thread-safety: one asyncio loop, like the proxy.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from syncd.engine.proxy.chat_template import ChatTemplate
from syncd.engine.proxy.record import Turn, now
from syncd.engine.proxy import sse
from syncd.engine.proxy.turn import (TRAJECTORY_HEADER, ClientStream, check_complete, client_wants, error_response,
                               upstream_body)
from syncd.records.trajectory import COMPACTION_ROLES

__all__ = ["CompactionConfig", "Compactor", "ROLES", "SUMMARY_MODES"]

log = logging.getLogger(__name__)

ROLES = COMPACTION_ROLES
SUMMARY_MODES = ("model", "empty", "truncate")
ENDPOINTS = ("completions", "chat/completions")
#: members of a chat body that a completions segment has no use for (or reads otherwise: ``logprobs``)
CHAT_ONLY = frozenset({"messages", "tools", "tool_choice", "parallel_tool_calls", "response_format", "logprobs",
                       "top_logprobs", "max_completion_tokens", "chat_template", "chat_template_kwargs",
                       "add_generation_prompt", "continue_final_message", "documents", "reasoning_effort"})
SUMMARY_PROMPT = "\n\nYou are near the end of your context. Summarize your work so far: the task, what is done, " \
                 "what is left.\nSummary:"
RESUME_PROMPT = "\n\nYour summary of your earlier work:\n"
CONTINUE_PROMPT = "\n\nContinue where you stopped:\n"


@dataclass(frozen=True)
class CompactionConfig:
    """``window``: the context window in tokens; ``tokenizer``: the model's ``tokenizer.json`` (or its folder);
    ``trigger``: the share of the window a segment may fill, in (0, 1]; ``summary_tokens``: the summary's
    ``max_tokens``; ``keep_prompt``: tokens of the original prompt kept at the head of a continuation (the task
    statement); the three prompts are texts (tokenised once, at start-up); ``summary``: one of ``SUMMARY_MODES``
    (``"model"``; ``"empty"`` and ``"truncate"`` are the ablations of the module docstring)."""

    window: int
    tokenizer: str
    trigger: float = 0.75
    summary_prompt: str = SUMMARY_PROMPT
    resume_prompt: str = RESUME_PROMPT
    continue_prompt: str = CONTINUE_PROMPT
    summary_tokens: int = 64
    keep_prompt: int = 64
    max_compactions: int = 64
    summary: str = "model"

    def __post_init__(self):
        if self.window < 8:
            raise ValueError(f"compaction window must be at least 8 tokens, got {self.window}")
        if not 0 < self.trigger <= 1:
            raise ValueError(f"compaction trigger must be in (0, 1], got {self.trigger}")
        if self.summary_tokens < 1 or self.keep_prompt < 0 or self.max_compactions < 1:
            raise ValueError("compaction summary_tokens and max_compactions must be >= 1, keep_prompt >= 0")
        if self.summary not in SUMMARY_MODES:
            raise ValueError(f"compaction summary must be one of {', '.join(SUMMARY_MODES)}, got {self.summary!r}")

    @classmethod
    def for_model(cls, model_dir, **kw) -> "CompactionConfig":
        """The window from ``config.json``'s ``max_position_embeddings`` and the model's tokenizer (``kw``
        override; a ``window`` past the model's positions is refused). Raises ValueError naming the file."""
        path = Path(model_dir, "config.json")
        try:
            positions = json.loads(path.read_text())["max_position_embeddings"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}: no max_position_embeddings to take the compaction window from "
                             f"({type(exc).__name__}: {exc})") from None
        if not isinstance(positions, int) or isinstance(positions, bool) or positions < 1:
            raise ValueError(f"{path}: max_position_embeddings {positions!r} is not a positive integer")
        window = kw.setdefault("window", positions)
        if window > positions:
            raise ValueError(f"compaction window {window} is past the model's {positions} positions ({path})")
        return cls(tokenizer=str(model_dir), **kw)

    @property
    def budget(self) -> int:
        """Positions a segment's context and output may fill."""
        return math.floor(self.trigger * self.window)


@dataclass
class _Live:
    """A compacted trajectory's state: the text the client saw, and the context the engine holds for it;
    ``unseen``: the text of a special token the model stopped on (``<|im_end|>``), in the context but not in the
    client's text -- a next prompt that starts with it (a chat template closing the assistant's message) is not
    given it twice."""

    client_text: str
    context: list[int]
    head: list[int]
    unseen: str = ""


@dataclass
class _Request:
    """A compacted run: ``context`` (the ids to generate from), ``head`` (kept at every continuation's head);
    ``tail``: for a later request of a live trajectory, the ids of its new text, not yet in ``context``."""

    context: list[int]
    head: list[int]
    prompt_text: str | None
    max_tokens: int
    endpoint: str = "completions"
    tail: list[int] = field(default_factory=list)


REFUSALS = ("max_compactions", "too_long")


def _constrained(body: dict) -> bool:
    """Whether a chat body asks the frontend to constrain its output (a forced tool call, a response format):
    what a compacted run, whose segments are plain completions, cannot keep."""
    choice, fmt = body.get("tool_choice"), body.get("response_format")
    forced = choice is not None and choice not in ("auto", "none")
    return forced or (fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"))


class Compactor:
    """Runs compacted requests for a :class:`syncd.engine.proxy.server.Proxy` (see the module docstring). Counts
    compactions done and requests refused by reason (``REFUSALS``) in :meth:`stats` and, given a Prometheus
    ``registry``, as ``syncd_proxy_compactions_total`` and ``syncd_proxy_compactions_refused_total{reason}``. It
    holds a live context per open compacted trajectory only: :meth:`forget` drops it when the proxy writes the
    trajectory (or fails to)."""

    def __init__(self, config: CompactionConfig, registry=None):
        from tokenizers import Tokenizer

        self.config = config
        path = Path(config.tokenizer)
        path = path / "tokenizer.json" if path.is_dir() else path
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # noqa: BLE001 -- tokenizers raises a bare Exception for a missing or bad file
            raise ValueError(f"{path}: not a tokenizer the compactor can read: {exc}") from None
        self.chat = ChatTemplate.from_folder(path.parent)
        if self.chat is None:
            log.warning("%s has no chat template: chat requests pass through uncompacted", path.parent)
        self.summary_ids = self.encode(config.summary_prompt)
        self.resume_ids = self.encode(config.resume_prompt)
        self.continue_ids = self.encode(config.continue_prompt)
        if config.budget + len(self.summary_ids) + config.summary_tokens > config.window:
            raise ValueError(f"compaction leaves no room for the summary: trigger * window = {config.budget}, "
                             f"summary prompt {len(self.summary_ids)} + summary tokens {config.summary_tokens}, "
                             f"window {config.window}")
        fixed = config.keep_prompt + len(self.resume_ids) + config.summary_tokens + len(self.continue_ids)
        if fixed >= config.budget:
            raise ValueError(f"a continuation context ({fixed} tokens: kept prompt, resume and continue prompts, "
                             f"summary) leaves no room to generate in {config.budget} tokens")
        self._live: dict[str, _Live] = {}
        self.compactions = 0
        self.refused = dict.fromkeys(REFUSALS, 0)
        self._metrics = None
        if registry is not None:
            from prometheus_client import Counter

            refused = Counter("syncd_proxy_compactions_refused", "compacted requests refused, by reason",
                              ["reason"], registry=registry)
            for r in REFUSALS:
                refused.labels(r)
            self._metrics = (Counter("syncd_proxy_compactions", "compactions done (summaries taken)",
                                     registry=registry), refused)

    def stats(self) -> dict:
        """``{"done", "refused": {reason: n}, "live"}`` (live: trajectories with a live context)."""
        return {"done": self.compactions, "refused": dict(self.refused), "live": len(self._live)}

    def forget(self, tid: str) -> None:
        """Drop the live context of trajectory ``tid`` (it was finished)."""
        self._live.pop(tid, None)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def _unseen(self, ids: list[int]) -> str:
        """The text of ``ids`` when they are special tokens (which the client's text does not show), else ""."""
        if not ids or self.tokenizer.decode(ids, skip_special_tokens=True):
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    # ------------------------------------------------------------------------------------ policy

    def _prompt(self, body: dict, endpoint: str):
        """``(prompt, max_tokens)`` of a body this compactor may run (a text or token ids), else None."""
        if endpoint not in ENDPOINTS or (body.get("n") or 1) != 1 or body.get("echo"):
            return None
        if endpoint == "completions":
            prompt, max_tokens = body.get("prompt"), body.get("max_tokens")
            max_tokens = 16 if max_tokens is None else max_tokens  # the OpenAI default
        else:
            max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
            if self.chat is None or max_tokens is None or _constrained(body):
                return None
            prompt = self.chat.render(body)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            return None  # the frontend answers what is wrong
        return prompt, max_tokens

    def plan(self, tid: str, body: dict, endpoint: str) -> _Request | None:
        """The compacted run of ``body``, or None when it goes the proxy's usual way."""
        got = self._prompt(body, endpoint)
        if got is None:
            return None
        prompt, max_tokens = got
        live = self._live.get(tid)
        if isinstance(prompt, str):
            if live is not None and prompt.startswith(live.client_text):
                new = prompt[len(live.client_text):]
                new = new[len(live.unseen):] if live.unseen and new.startswith(live.unseen) else new
                return _Request(live.context, live.head, prompt, max_tokens, endpoint, self.encode(new))
            ids, text = self.encode(prompt), prompt
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in prompt):
            ids, text = list(prompt), None
        else:
            return None
        if len(ids) + max_tokens <= self.config.budget:
            return None
        if len(ids) + len(self.summary_ids) + self.config.summary_tokens > self.config.window:
            return None  # too long even to summarize: the usual path, where the engine decides
        return _Request(ids, ids[:self.config.keep_prompt], text, max_tokens, endpoint)

    # ------------------------------------------------------------------------------------ running

    async def run(self, proxy, req: _Request, traj, tid: str, body: dict, request: web.Request):
        """Run ``req`` (segments, summaries, continuations), record each segment in ``traj``, answer the client.
        A context that leaves no room to generate (a long prompt, a long live context) is summarized first; a
        later request's new text (``req.tail``: a tool's output, the next user message) that would leave no room
        to summarize after it is appended after a compaction of the live context instead."""
        cfg = self.config
        run = _Run(self, proxy, traj, tid, request, number=len(traj.turns), first={"client_request": body},
                   base={k: v for k, v in body.items() if k not in {"stream", "stream_options"} |
                         (CHAT_ONLY if req.endpoint == "chat/completions" else set())})
        context, left, visible = list(req.context), req.max_tokens, []
        if req.tail and len(context) + len(req.tail) + len(self.summary_ids) + cfg.summary_tokens > cfg.window:
            context, err = await run.compact(req, context)
            if err is not None:
                return err
        context += req.tail
        while True:
            room = cfg.budget - len(context)
            if room >= 1:
                role = "continuation" if run.compactions else "generate"
                turn, err = await run.segment(context, min(left, room), role)
                if err is not None:
                    return err
                visible.append(turn)
                left -= len(turn.output_token_ids)
                if turn.finish_reason != "length" or left <= 0:
                    break
                context = context + turn.output_token_ids
            context, err = await run.compact(req, context, f" and {left} tokens still to make")
            if err is not None:
                return err
        last = visible[-1]
        text = "".join(t.text for t in visible)
        if req.prompt_text is not None:
            self._live[tid] = _Live(req.prompt_text + text, last.prompt_token_ids + last.output_token_ids,
                                    req.head, self._unseen(last.output_token_ids[-1:]))
        return await self._answer(req.endpoint, body, request, tid, visible, text, run.compactions,
                                  len(req.context) + len(req.tail))

    async def _segment(self, proxy, traj, tid, base, request, prompt_ids, max_tokens, meta):
        """One upstream request of the compacted run (``base``: the client's body as a completions body), recorded
        as a turn; ``(turn, None)`` or ``(turn, the error response)``."""
        seg_body = {**base, "prompt": list(prompt_ids), "max_tokens": max_tokens}
        turn = Turn(index=len(traj.turns), endpoint="completions", request=seg_body, stream=False)
        turn.compaction = meta
        turn.prompt_token_ids = list(prompt_ids)  # the frontend annotates text prompts only
        async with proxy.running_turn(tid, traj, turn, " of this segment") as state:
            err = await proxy.attempts(state, upstream_body(seg_body), "completions", ClientStream(request, turn, tid))
            if err is None:
                check_complete(state)
                if turn.status != "failed" and turn.prompt_token_ids != list(prompt_ids):
                    turn.fail("the frontend annotated other prompt token ids than the proxy sent")
                if turn.status == "failed":
                    err = error_response(502, turn.error, "upstream_error")
                else:
                    turn.status, turn.finished_at = "ok", now()
            return turn, err

    def _refuse(self, traj, number: int, kind: str, reason: str) -> web.Response:
        self.refused[kind] += 1
        if self._metrics is not None:
            self._metrics[1].labels(kind).inc()
        turn = Turn(index=len(traj.turns), endpoint="completions", request={}, stream=False)
        turn.compaction = {"request": number, "segment": -1, "role": "generate"}
        traj.turns.append(turn)
        turn.fail(f"compaction: {reason}")
        return error_response(400, turn.error, "invalid_request_error")

    async def _answer(self, endpoint: str, body: dict, request: web.Request, tid: str, visible: list[Turn],
                      text: str, compactions: int, prompt_tokens: int):
        """The one answer of a compacted request, in the form of the client's ``endpoint``."""
        last = visible[-1]
        n_out = sum(len(t.output_token_ids) for t in visible)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n_out, "total_tokens": prompt_tokens + n_out}
        nvext = {"compactions": compactions}
        wants_fields, _, wants_usage = client_wants(body)
        if "engine_data" in wants_fields:
            nvext["engine_data"] = {"syncd": 1, "request_id": last.request_id,
                                    "token_ids": [x for t in visible for x in t.output_token_ids],
                                    "versions": [x for t in visible for x in t.versions],
                                    "logprobs": [x for t in visible for x in t.logprobs]}
        if endpoint == "chat/completions":
            message, stream = {"role": "assistant", "content": text}, bool(body.get("stream"))
            choice = {"index": 0, "delta": message} if stream else {"index": 0, "message": {**message, "refusal": None}}
            kind = "chat.completion.chunk" if stream else "chat.completion"
        else:
            choice, kind = {"index": 0, "text": text}, "text_completion"
        choice.update(finish_reason=last.finish_reason, logprobs=None)
        out = {"id": visible[0].response_id, "object": kind, "created": int(time.time()), "model": body.get("model"),
               "choices": [choice], "usage": usage, "nvext": nvext}
        headers = {TRAJECTORY_HEADER: tid, "X-Syncd-Turn": str(visible[0].index),
                   "X-Syncd-Compactions": str(compactions)}
        if not body.get("stream"):
            return web.json_response(out, headers=headers)
        resp = web.StreamResponse(status=200, headers={**headers, "Content-Type": "text/event-stream",
                                                       "Cache-Control": "no-cache"})
        await resp.prepare(request)
        chunk = dict(out)
        if not wants_usage:
            chunk.pop("usage")
        await resp.write(sse.format_event(chunk))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


class _Run:
    """One client request's compacted run: numbers its segments and counts its compactions (``Compactor.run``)."""

    def __init__(self, compactor: Compactor, proxy, traj, tid: str, request: web.Request, *, number: int,
                 first: dict, base: dict):
        self.c, self.proxy, self.traj, self.tid, self.request = compactor, proxy, traj, tid, request
        self.number, self.first, self.base = number, first, base  # base: every segment's body, less prompt and bound
        self.segments = self.compactions = 0

    async def segment(self, prompt_ids: list[int], max_tokens: int, role: str):
        """Send and record the next segment; ``(turn, error response or None)``."""
        meta = {"request": self.number, "segment": self.segments, "role": role, **self.first}
        self.segments, self.first = self.segments + 1, {}
        return await self.c._segment(self.proxy, self.traj, self.tid, self.base, self.request, prompt_ids,
                                     max_tokens, meta)

    async def compact(self, req: _Request, context: list[int], left: str = ""):
        """``context`` compacted as the configuration says: ``(the continuation's context, None)``, or
        ``(None, an error response)`` when it cannot be (``max_compactions`` used up, too long to summarize)."""
        c, cfg = self.c, self.c.config
        if self.compactions == cfg.max_compactions:
            return None, c._refuse(self.traj, self.number, "max_compactions", f"{self.compactions} compactions{left}")
        if len(context) + len(c.summary_ids) + cfg.summary_tokens > cfg.window:
            return None, c._refuse(self.traj, self.number, "too_long",
                                   f"a context of {len(context)} tokens is too long to summarize within the "
                                   f"{cfg.window}-token window")
        if cfg.summary == "model":
            summary, err = await self.segment(context + c.summary_ids, cfg.summary_tokens, "summary")
            if err is not None:
                return None, err
            context = req.head + c.resume_ids + summary.output_token_ids + c.continue_ids
        elif cfg.summary == "empty":
            context = req.head + c.resume_ids + c.continue_ids
        else:  # plain truncation, as long as a summarized context
            context = req.head + context[-(len(c.resume_ids) + cfg.summary_tokens + len(c.continue_ids)):]
        self.compactions += 1
        c.compactions += 1
        if c._metrics is not None:
            c._metrics[0].inc()
        return context, None
