"""Self-compaction on the shipped toy task with a context too small for it: success with compaction versus without,
and the share of training samples that are prefix-consistent (goal 100%).

    python -m bench.compaction                       # window 128, repeat task of 256 tokens, 8 requests
    python -m bench.compaction --json c.json --plot c.png

The model: a tiny Qwen2 (``syncd.engine.reference.make_tiny`` sizes, ``max_position_embeddings = --window``) trained
for ``--train-steps`` real AdamW steps on the ``repeat`` task's language (a letter, ``:``, then that letter, with a
``:`` here and there), so that it can solve the task -- the figure is then whether the context lets it. The task:
``syncd.trainer.rl.tasks`` ``repeat`` with ``--length`` answer tokens (longer than the window), scored by its
own reward.
One node (the Dynamo frontend and a reference-engine worker recording replay records) serves two sandbox proxies
in this process, one without compaction (the baseline: the window cuts the answer) and one with
(``syncd.engine.proxy.compaction``; summary, resume and continue prompts of one ``:`` each, ``--summary-tokens``);
every request is one trajectory, finished with its reward. The compacted trajectories are read back
(``syncd.trainer.rl.rollouts`` + ``syncd.trainer.rl.compaction.training_samples``) and every sample is checked
against its record (``prefix_consistent``).

What this shows is that segmentation extends the output past the window; it cannot show that the summary carries
the working state (the task's whole prompt is kept in every continuation, so any summary, even an empty one, does
as well). ``bench.compaction_recall`` measures that, on chat requests, with the same proxy path and the same
helpers (:func:`serve_arm`, :func:`serving`, :func:`samples`): a key only the compacted-away context holds, the
model's summary against an empty summary and plain truncation.

Figures (JSON; ``--plot`` draws them): per arm ``success`` (share of requests whose reward is at least
``--success-at``), ``complete`` (share whose answer has every one of the task's tokens), ``reward_mean``, tokens
per request, compactions per request; the ratio of the success rates; ``prefix_consistent`` (samples, consistent,
fraction) and the share of trained tokens that are summaries.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench._report import Row, finish, output_flags
from bench._timing import Stopwatch

log = logging.getLogger("bench.compaction")

RUN = "bench-compaction"
SEPARATOR = ":"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.compaction", description=__doc__.split("\n\n")[0])
    p.add_argument("--window", type=int, default=128, help="the engine's context window in tokens")
    p.add_argument("--length", type=int, default=256, help="answer tokens of the repeat task (> window)")
    p.add_argument("--requests", type=int, default=8, help="requests per arm (task items 0..N-1)")
    p.add_argument("--trigger", type=float, default=0.75, help="compaction trigger (share of the window)")
    p.add_argument("--summary-tokens", type=int, default=8)
    p.add_argument("--keep-prompt", type=int, default=2, help="tokens of the task prompt kept in a continuation")
    p.add_argument("--train-steps", type=int, default=60, help="AdamW steps teaching the model the task")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--success-at", type=float, default=0.9, help="the reward that counts as solved")
    p.add_argument("--seed", type=int, default=0)
    output_flags(p, "compaction")
    return p


def _example(rng: torch.Generator, length: int, ids: dict) -> list[int]:
    """``X:XXXX:XX...``: a letter of the task's alphabet, ``:``, the letter repeated with a ``:`` now and then
    (what a compacted context looks like to the model: the task's head, separators, its own letters)."""
    letter = ids["abcd"[int(torch.randint(4, (1,), generator=rng))]]
    seq = [letter, ids[SEPARATOR]]
    while len(seq) < length:
        seq.append(ids[SEPARATOR] if float(torch.rand(1, generator=rng)) < 0.02 else letter)
    return seq


def train_repeat(model, tokenizer, steps: int, *, length: int, seed: int) -> float:
    """``steps`` AdamW steps of next-token loss on :func:`_example` sequences; returns the last loss."""
    ids = {ch: tokenizer.encode(ch, add_special_tokens=False).ids[0] for ch in "abcd" + SEPARATOR}
    rng = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loss = float("nan")
    model.train()
    for _ in range(steps):
        x = torch.tensor([_example(rng, length, ids) for _ in range(8)])
        out = model(input_ids=x[:, :-1], labels=x[:, 1:].contiguous()).loss
        out.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = float(out.detach())
    return loss


def _model_folder(root: Path, args):
    from tokenizers import Tokenizer

    from bench.rollouts import _write_folder
    from syncd.engine.reference.make_tiny import model_config, random_model, tokenizer_json

    cfg = model_config("qwen2", hidden=args.hidden, layers=2, intermediate=2 * args.hidden,
                       max_positions=args.window)
    model = random_model(cfg, args.seed)
    tok = Tokenizer.from_str(tokenizer_json())
    loss = train_repeat(model, tok, args.train_steps, length=min(args.window, 96), seed=args.seed)
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    return _write_folder(root / "model", cfg, model, state), loss


async def serve_arm(node, compaction, sandbox: str, requests, score, *, endpoint: str = "completions") -> list[dict]:
    """Every request of one arm through its own sandbox proxy (``compaction``: a ``CompactionConfig``, or None),
    in order: ``requests`` are ``(item, body)``; ``score(item, reply)`` is the request's reward, with which its
    trajectory (one per request, ``t000``, ``t001``, ...) is finished. Rows ``{"tid", "reward", "tokens",
    "compactions", "text"}``; RuntimeError when a request or a finish fails."""
    import aiohttp

    from syncd.engine.proxy.server import Proxy, ProxyConfig

    proxy = Proxy(ProxyConfig(upstream=node.frontend_url, run_id=RUN, sandbox_id=sandbox, compaction=compaction),
                  node.store_url)
    base = await proxy.start()
    rows = []
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
            for k, (item, body) in enumerate(requests):
                tid = f"t{k:03d}"
                async with http.post(f"{base}/v1/{endpoint}", json={"model": node.config.model_name, **body},
                                     headers={"X-Syncd-Trajectory": tid}) as r:
                    reply = await r.json()
                    if r.status != 200:
                        raise RuntimeError(f"{sandbox} request {k}: HTTP {r.status}: {reply}")
                reward = score(item, reply)
                async with http.post(f"{base}/syncd/trajectories/{tid}/finish",
                                     json={"metadata": {"reward": reward, "item": k}}) as r:
                    done = await r.json()
                    if not done.get("written") or done.get("status") != "complete":
                        raise RuntimeError(f"{sandbox} trajectory {tid}: {done}")
                ch = reply["choices"][0]
                rows.append({"tid": tid, "reward": reward, "tokens": int(reply["usage"]["completion_tokens"]),
                             "compactions": (reply.get("nvext") or {}).get("compactions", 0),
                             "text": ch["message"]["content"] if "message" in ch else ch["text"]})
    finally:
        await proxy.close()
    return rows


async def _arm(node, compaction, sandbox: str, task, args) -> list[dict]:
    """The repeat task's requests (items 0..N-1) through :func:`serve_arm`, scored by the task's reward."""
    from syncd.trainer.rl.tasks import Sample

    def score(item, reply):
        ch = reply["choices"][0]
        return task.reward(Sample(item, ch["text"], ch["finish_reason"], int(reply["usage"]["completion_tokens"])))

    requests = []
    for k in range(args.requests):
        item = task.item(k, args.seed)
        requests.append((item, {"prompt": item.prompt, "max_tokens": task.max_tokens, "temperature": args.temperature,
                                "top_k": 20, "seed": args.seed + k, "ignore_eos": True}))
    return await serve_arm(node, compaction, sandbox, requests, score)


def _summary(rows: list[dict], length: int, success_at: float) -> dict:
    n = len(rows)
    return {"requests": n, "success": sum(r["reward"] >= success_at for r in rows) / n,
            "complete": sum(r["tokens"] >= length for r in rows) / n,
            "reward_mean": sum(r["reward"] for r in rows) / n, "tokens_mean": sum(r["tokens"] for r in rows) / n,
            "compactions_mean": sum(r["compactions"] for r in rows) / n}


def samples(store_url: str, sandbox: str) -> dict:
    """The sandbox's compacted trajectories read back as training samples, each checked against its record:
    ``{"trajectories", "dropped", "samples", "consistent", "fraction", "trained_tokens", "summary_token_share"}``."""
    from syncd.records.trajectory import read_record
    from syncd.trainer.rl.compaction import prefix_consistent, training_samples
    from syncd.trainer.rl.rollouts import MissingReplayError, read_rollouts

    deadline = time.monotonic() + 120
    while True:
        try:
            rs = read_rollouts(store_url, RUN, sandbox_id=sandbox, vocab_size=320)
            break
        except MissingReplayError:  # the engine writes its replay records just after a request ends
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    total = consistent = trained = summary = 0
    for ro in rs.rollouts:
        doc = read_record(store_url, RUN, ro.sandbox_id, ro.trajectory_id)
        summaries = sum(len(t["output_token_ids"]) for t in doc["turns"]
                        if (t.get("compaction") or {}).get("role") == "summary")
        for s in training_samples(ro):
            total += 1
            consistent += prefix_consistent(s, doc)
            trained += int(s.sequence.loss_mask.sum())
        summary += summaries
    return {"trajectories": len(rs.rollouts), "dropped": dict(rs.dropped), "samples": total, "consistent": consistent,
            "fraction": consistent / total if total else None, "trained_tokens": trained,
            "summary_token_share": summary / trained if trained else None}


class ServedNode:
    """What an arm needs of a started ``syncd.engine.dynamo.node.Node``: its frontend, model name and store."""

    def __init__(self, node, store_url):
        self.node, self.store_url = node, store_url
        self.frontend_url, self.config = node.frontend_url, node.config


@contextlib.contextmanager
def serving(model_dir: Path, root: Path, prefix: str = "b"):
    """A node serving ``model_dir`` (the Dynamo frontend and a reference-engine worker recording replay records to
    a file store under ``root``) as a :class:`ServedNode`; closed on exit, after which its replay records are in."""
    from syncd.engine.dynamo.node import Node, NodeConfig

    store = root / "store"
    store.mkdir()
    cfg = NodeConfig.recording(model_dir, root, store_url=store.as_uri(), run_id=RUN, prefix=prefix)
    node = Node(cfg).start()
    try:
        yield ServedNode(node, store.as_uri())
    finally:
        node.close()  # the worker drains and flushes its replay records


def run(args) -> dict:
    from syncd.engine.proxy.compaction import CompactionConfig
    from syncd.trainer.rl.tasks import get_task

    if args.length <= args.window:
        raise ValueError(f"--length {args.length} fits the --window {args.window}: nothing to show")
    sw = Stopwatch()
    task = get_task("repeat", length=args.length)
    with tempfile.TemporaryDirectory(prefix="bench-compaction-") as tmp:
        root = Path(tmp)
        model_dir, loss = _model_folder(root, args)
        with serving(model_dir, root) as n:
            compaction = CompactionConfig.for_model(model_dir, trigger=args.trigger, summary_tokens=args.summary_tokens,
                                                    keep_prompt=args.keep_prompt, summary_prompt=SEPARATOR,
                                                    resume_prompt=SEPARATOR, continue_prompt=SEPARATOR)
            without = asyncio.run(_arm(n, None, "sb-plain", task, args))
            with_ = asyncio.run(_arm(n, compaction, "sb-compact", task, args))
        consistent = samples(n.store_url, "sb-compact")
    a, b = _summary(with_, args.length, args.success_at), _summary(without, args.length, args.success_at)
    return {"bench": "compaction", "config": {k: v for k, v in vars(args).items() if k not in ("json", "plot")},
            "train_loss": loss, "with_compaction": a, "without_compaction": b,
            "success_ratio": a["success"] / b["success"] if b["success"] else None,
            "reward_ratio": a["reward_mean"] / b["reward_mean"] if b["reward_mean"] else None,
            "prefix_consistent": consistent, "rows": {"with": with_, "without": without},
            "wall_s": sw.elapsed, "python": sys.version.split()[0], "torch": torch.__version__,
            "machine": platform.machine()}


def rows(out: dict) -> list[Row]:
    """The shared columns: the mean reward with compaction against the run without it (no time: seconds '-')."""
    c = out["config"]
    return [Row("with compaction (reward)", None, out["reward_ratio"], "without compaction",
                f"{c['requests']} req x {c['length']} tok, window {c['window']}")]


def plot(out: dict, path: Path) -> None:
    from bench._plot import pyplot, save

    plt = pyplot()
    keys = ["success", "complete", "reward_mean"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = range(len(keys))
    ax.bar([i - 0.2 for i in x], [out["without_compaction"][k] for k in keys], 0.4, label="without compaction")
    ax.bar([i + 0.2 for i in x], [out["with_compaction"][k] for k in keys], 0.4, label="with compaction")
    ax.set_xticks(list(x), keys)
    ax.set_ylim(0, 1.05)
    c = out["config"]
    frac = out["prefix_consistent"]["fraction"]
    ax.set_title(f"repeat task of {c['length']} tokens, {c['window']}-token window; prefix-consistent samples "
                 f"{100 * (frac or 0):.0f}%", fontsize=9)
    ax.legend(fontsize=8)
    save(fig, path, dpi=120)


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        out = run(args)
    except ValueError as exc:
        print(f"bench.compaction: {exc}", file=sys.stderr)
        return 2
    a, b, s = out["with_compaction"], out["without_compaction"], out["prefix_consistent"]
    print(f"syncd compaction benchmark: repeat task of {args.length} tokens, window {args.window}, "
          f"{args.requests} requests per arm, model trained {args.train_steps} steps (loss {out['train_loss']:.3f})")
    print(f"{'':22s}{'success':>9s}{'complete':>10s}{'reward':>8s}{'tokens':>8s}{'compactions':>13s}")
    for name, r in (("without compaction", b), ("with compaction", a)):
        print(f"{name:22s}{r['success']:9.2f}{r['complete']:10.2f}{r['reward_mean']:8.3f}{r['tokens_mean']:8.0f}"
              f"{r['compactions_mean']:13.1f}")
    ratio = out["reward_ratio"]
    print(f"reward ratio with/without: {ratio:.2f}x" if ratio else "reward ratio: without compaction scored 0")
    print(f"prefix-consistent samples: {s['consistent']} of {s['samples']} ({100 * (s['fraction'] or 0):.1f}%; goal "
          f"100%), summaries {100 * (s['summary_token_share'] or 0):.1f}% of trained tokens")
    return finish("compaction", args, out, rows(out), lambda path: plot(out, path))


if __name__ == "__main__":
    sys.exit(main())

