"""Self-compaction that can fail: a chat whose answer is a key that only the part of the context compaction removes
holds, answered after the model's own summary, an empty summary, or plain truncation, on the same requests.

    python -m bench.compaction_recall                     # window 64, 32 requests per arm, 200 warm-up steps
    python -m bench.compaction_recall --warmup-steps 0    # an untrained (random-init) policy: it should not win
    python -m bench.compaction_recall --no-summary-demos  # a control: no summary is ever demonstrated
    python -m bench.compaction_recall --json r.json --plot r.png

**Task.** One user message ``k=<key>;<filler>?`` (the key: ``--key-length`` letters of ``--keys``; the filler:
random digits, so long that the rendered chat -- ``u:<message>\\na:`` under the compact chat template,
``syncd.trainer.agent.warmup.COMPACT_TEMPLATE`` -- passes the compaction budget ``floor(trigger * window)`` while
it still fits the window with the summary prompt and summary), ``max_tokens`` = the key's length. The proxy
(``syncd.engine.proxy.compaction``, chat path) therefore compacts before the first answer token: the continuation
keeps the rendered chat's first ``keep_prompt`` = 2 tokens (``u:``), which never hold the key, so the answer can
come from what replaced the rest only. Success: the answer equals the key; reward = the share of its letters right.

**Arms**, all through one Dynamo frontend and reference engine (recording replay records), one sandbox proxy each,
on the same requests (items, sampling seeds): ``summary`` (``CompactionConfig.summary="model"``: the model's own
summary, ``--summary-tokens`` = key length + 1), ``empty_summary`` (``"empty"``) and ``truncation``
(``"truncate"``: the head and the most recent tokens, as many as a summarized context holds), and
``full_context`` (no compaction: the prompt fits the window; what the policy does with everything in view). A
policy that ignores the summary scores about ``len(keys) ** -key_length`` in every compacted arm.

**Policy.** A tiny Qwen2 (``--hidden``, 2 layers, ``max_position_embeddings = --window``) taught to summarise by a
short supervised warm-up (``--warmup-steps`` AdamW steps, loss on the completion tokens only) on synthetic
demonstrations built in token space from the proxy's own pieces (the chat template, the summary, resume and
continue prompts of the same ``Compactor``), on items drawn apart from the benchmark's: the summary segment
(rendered chat + summary prompt -> ``<key>.``), the continuation (head + resume + ``<key>.`` + continue ->
``<key>``) and the direct answer (rendered chat -> ``<key>``); ``--no-summary-demos`` leaves the summaries out (a
control: the policy reads a summary back but was never taught to write one). No demonstration is a benchmark request, and
nothing makes the summary arm win by construction: an untrained policy writes no key into its summary
(``--warmup-steps 0`` scores as the ablations do). The warm-up is said in the figures (``warm_up``).

Figures (JSON): per arm ``success``, ``reward_mean``, ``compactions_mean``; ``success_summary``,
``success_empty_summary``, ``success_truncation``, ``success_full_context``, ``margin`` (summary minus the better
ablation; goal >= 0.3); ``summary_has_key`` (share of summaries that hold the key); ``prefix_consistent`` per
compacted arm (``bench.compaction.samples``) and ``prefix_consistent_frac`` over all of them (goal 1.0).
``bench.agent`` reports these as its ``compaction`` member.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import platform
import random
import sys
import tempfile
from pathlib import Path

import torch

from bench._report import Row, finish, output_flags
from bench._timing import Stopwatch
from bench.compaction import serve_arm, samples, serving

log = logging.getLogger("bench.compaction_recall")

FILLER = "0123456789"
PROMPTS = {"summary_prompt": "\ns:", "resume_prompt": "\nr:", "continue_prompt": "\na:"}
KEEP_PROMPT = 2
#: arm -> CompactionConfig.summary (None: no compaction)
ARMS = {"summary": "model", "empty_summary": "empty", "truncation": "truncate", "full_context": None}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.compaction_recall", description=__doc__.split("\n\n")[0])
    p.add_argument("--window", type=int, default=64, help="the engine's context window in tokens")
    p.add_argument("--trigger", type=float, default=0.75, help="compaction trigger (share of the window)")
    p.add_argument("--requests", type=int, default=32, help="requests per arm (the same in every arm)")
    p.add_argument("--keys", default="abcdefgh", help="the key's alphabet (no digit: the filler is digits)")
    p.add_argument("--key-length", type=int, default=2)
    p.add_argument("--warmup-steps", type=int, default=200, help="supervised warm-up steps (0: untrained policy)")
    p.add_argument("--warmup-batch", type=int, default=32)
    p.add_argument("--no-summary-demos", action="store_true",
                   help="a control: warm up on continuations and direct answers only (not taught to summarise)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of the requests")
    p.add_argument("--seed", type=int, default=0)
    output_flags(p, "compaction_recall")
    return p


class Recall:
    """The task in the proxy's own token space: ``compactor`` (the summary arm's ``Compactor``, for its chat template
    and prompts) and the filler lengths that make a rendered chat pass the budget yet fit the summary's window."""

    def __init__(self, compactor, args):
        if not args.keys or any(ch in FILLER for ch in args.keys) or args.key_length < 1:
            raise ValueError(f"--keys {args.keys!r} must be non-empty letters that are no digits, --key-length >= 1")
        self.c, self.args = compactor, args
        cfg = compactor.config
        self.overhead = overhead = len(self.prompt_ids(self.content("a" * args.key_length, "")))
        self.fill = (cfg.budget - overhead, cfg.window - len(compactor.summary_ids) - cfg.summary_tokens - overhead)
        if self.fill[0] > self.fill[1] or self.fill[0] < 1:
            raise ValueError(f"a {cfg.window}-token window at trigger {cfg.trigger} leaves no filler length that "
                             f"passes the budget {cfg.budget} and still fits the summary ({self.fill})")

    @staticmethod
    def content(key: str, filler: str) -> str:
        return f"k={key};{filler}?"

    def item(self, rng: random.Random) -> tuple[str, str]:
        """``(key, message)`` drawn from ``rng``."""
        key = "".join(rng.choice(self.args.keys) for _ in range(self.args.key_length))
        return key, self.content(key, "".join(rng.choice(FILLER) for _ in range(rng.randint(*self.fill))))

    def prompt_ids(self, message: str) -> list[int]:
        return self.c.encode(self.c.chat.render({"messages": [{"role": "user", "content": message}]}))

    def demonstration(self, rng: random.Random) -> tuple[list[int], list[int]]:
        """One synthetic ``(prompt ids, completion ids)``: a summary, a continuation or a direct answer."""
        key, message = self.item(rng)
        ctx, c, summary = self.prompt_ids(message), self.c, self.c.encode(key + ".")
        kind = rng.random()
        if self.args.no_summary_demos:
            kind = 0.4 + 0.6 * kind
        if kind < 0.4:
            return ctx + c.summary_ids, summary
        if kind < 0.8:
            return ctx[:KEEP_PROMPT] + c.resume_ids + summary + c.continue_ids, c.encode(key)
        return ctx, c.encode(key)


def warm_up(model, recall: Recall, args) -> float:
    """``--warmup-steps`` AdamW steps of next-token loss on the completions of fresh demonstrations (right-padded,
    the prompt and padding masked); returns the last loss (NaN for no step)."""
    rng = random.Random(args.seed + 1)  # the benchmark's items come from another stream
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loss = float("nan")
    model.train()
    for _ in range(args.warmup_steps):
        rows = [recall.demonstration(rng) for _ in range(args.warmup_batch)]
        width = max(len(p) + len(c) for p, c in rows)
        x = torch.zeros(len(rows), width, dtype=torch.long)
        y = torch.full((len(rows), width), -100, dtype=torch.long)
        for i, (p, c) in enumerate(rows):
            x[i, :len(p) + len(c)] = torch.tensor(p + c)
            y[i, len(p):len(p) + len(c)] = torch.tensor(c)
        out = model(input_ids=x, labels=y).loss  # the model shifts the labels
        out.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = float(out.detach())
    model.eval()
    return loss


def _compaction(model_dir: Path, args, summary: str = "model"):
    from syncd.engine.proxy.compaction import CompactionConfig

    return CompactionConfig.for_model(model_dir, trigger=args.trigger, summary_tokens=args.key_length + 1,
                                      keep_prompt=KEEP_PROMPT, summary=summary, **PROMPTS)


def _model_folder(root: Path, args):
    """The warmed-up policy's folder (compact chat template) and the task; returns ``(folder, recall, loss)``."""
    from bench.rollouts import _write_folder
    from syncd.engine.proxy.compaction import Compactor
    from syncd.engine.reference.make_tiny import model_config, random_model
    from syncd.trainer.agent.warmup import use_template

    cfg = model_config("qwen2", hidden=args.hidden, layers=2, intermediate=2 * args.hidden, max_positions=args.window)
    model = random_model(cfg, args.seed)
    folder = _write_folder(root / "model", cfg, model, {k: v.detach().to(torch.bfloat16)
                                                        for k, v in model.state_dict().items()})
    use_template(folder)
    recall = Recall(Compactor(_compaction(folder, args)), args)
    loss = warm_up(model, recall, args)
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    _write_folder(folder, cfg, model, state)
    use_template(folder)
    return folder, recall, loss


def _score(key: str, reply: dict) -> float:
    text = reply["choices"][0]["message"]["content"]
    return sum(a == b for a, b in zip(text, key)) / len(key)


def _summary_has_key(store_url: str, sandbox: str, keys: list[str]) -> float:
    from bench.compaction import RUN
    from syncd.records.trajectory import read_record

    hits = 0
    for k, key in enumerate(keys):
        doc = read_record(store_url, RUN, sandbox, f"t{k:03d}")
        hits += any(key in t["text"] for t in doc["turns"] if (t.get("compaction") or {}).get("role") == "summary")
    return hits / len(keys)


def run(args) -> dict:
    """The benchmark (see the module docstring); ValueError for settings that leave no task."""
    sw = Stopwatch()
    with tempfile.TemporaryDirectory(prefix="bench-recall-") as tmp:
        root = Path(tmp)
        model_dir, recall, loss = _model_folder(root, args)
        warm_s = sw.lap()
        rng = random.Random(args.seed + 10_000)
        items = [recall.item(rng) for _ in range(args.requests)]
        requests = [(key, {"messages": [{"role": "user", "content": msg}], "max_tokens": args.key_length,
                           "temperature": args.temperature, "seed": args.seed + k, "ignore_eos": True})
                    for k, (key, msg) in enumerate(items)]
        arms, consistent = {}, {}
        with serving(model_dir, root, prefix="r") as node:
            for arm, mode in ARMS.items():
                cfg = None if mode is None else _compaction(model_dir, args, mode)
                arms[arm] = asyncio.run(serve_arm(node, cfg, f"sb-{arm}", requests, _score,
                                                  endpoint="chat/completions"))
        for arm, mode in ARMS.items():
            if mode is not None:
                consistent[arm] = samples(node.store_url, f"sb-{arm}")
        has_key = _summary_has_key(node.store_url, "sb-summary", [k for k, _ in items])
    figures = {arm: {"success": sum(r["reward"] == 1.0 for r in rows) / len(rows),
                     "reward_mean": sum(r["reward"] for r in rows) / len(rows),
                     "compactions_mean": sum(r["compactions"] for r in rows) / len(rows)} for arm, rows in arms.items()}
    total = sum(c["samples"] for c in consistent.values())
    ok = sum(c["consistent"] for c in consistent.values())
    s = {arm: f["success"] for arm, f in figures.items()}
    return {"bench": "compaction_recall", "config": {k: v for k, v in vars(args).items() if k not in ("json", "plot")},
            "task": {"filler_tokens": list(recall.fill), "prompt_tokens": [recall.overhead + f for f in recall.fill],
                     "budget": recall.c.config.budget, "chance": len(args.keys) ** -args.key_length},
            "warm_up": {"steps": args.warmup_steps, "loss": loss, "wall_s": warm_s,
                        "summary_demos": not args.no_summary_demos,
                        "demonstrations": "synthetic: summary (chat + summary prompt -> key.), continuation "
                        "(head + resume + key. + continue -> key), direct answer; items apart from the benchmark's"},
            "arms": figures, "success_summary": s["summary"], "success_empty_summary": s["empty_summary"],
            "success_truncation": s["truncation"], "success_full_context": s["full_context"],
            "margin": s["summary"] - max(s["empty_summary"], s["truncation"]), "summary_has_key": has_key,
            "prefix_consistent": consistent, "prefix_consistent_frac": ok / total if total else None,
            "rows": {arm: [{k: r[k] for k in ("tid", "reward", "text", "compactions")} for r in rows]
                     for arm, rows in arms.items()},
            "wall_s": sw.elapsed, "python": sys.version.split()[0], "torch": torch.__version__,
            "machine": platform.machine()}


def rows(out: dict) -> list[Row]:
    """The shared columns: the summary arm's success against the better ablation (checked: margin >= 0.3)."""
    c = out["config"]
    return [Row("recall after compaction (success)", None, None,
                f"ablations {max(out['success_empty_summary'], out['success_truncation']):.2f}",
                f"{c['requests']} req, window {c['window']}: summary {out['success_summary']:.2f}",
                refcheck=out["margin"] >= 0.3 and out["prefix_consistent_frac"] == 1.0)]


def plot(out: dict, path: Path) -> None:
    from bench._plot import pyplot, save

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = list(ARMS)
    ax.bar(names, [out["arms"][a]["success"] for a in names], color=["C2", "C1", "C1", "C0"])
    ax.axhline(out["task"]["chance"], ls="--", color="grey", lw=0.8, label="chance")
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("success (answer == key)")
    ax.set_title(f"recall after compaction, {out['config']['window']}-token window, {out['config']['warmup_steps']} "
                 f"warm-up steps; prefix-consistent {100 * (out['prefix_consistent_frac'] or 0):.0f}%", fontsize=9)
    ax.legend(fontsize=8)
    save(fig, path, dpi=120)


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        out = run(args)
    except ValueError as exc:
        print(f"bench.compaction_recall: {exc}", file=sys.stderr)
        return 2
    t = out["task"]
    print(f"syncd compaction recall: window {args.window} (budget {t['budget']}), prompts of {t['prompt_tokens'][0]}-"
          f"{t['prompt_tokens'][1]} tokens, {args.requests} requests per arm, warm-up {args.warmup_steps} steps "
          f"(loss {out['warm_up']['loss']:.3f}), chance {t['chance']:.3f}")
    for arm, f in out["arms"].items():
        print(f"{arm:15s} success {f['success']:.2f}  reward {f['reward_mean']:.3f}  compactions "
              f"{f['compactions_mean']:.1f}")
    print(f"margin over the better ablation: {out['margin']:+.2f} (goal >= 0.3); summaries holding the key "
          f"{out['summary_has_key']:.2f}; prefix-consistent samples {out['prefix_consistent_frac']:.3f} (goal 1.0)")
    return finish("compaction_recall", args, out, rows(out), lambda path: plot(out, path))


if __name__ == "__main__":
    sys.exit(main())
