"""Real rollouts with weight updates landing mid-trajectory, for ``bench.replay`` and the replay tests.

:func:`generate` runs the whole production path on a tiny model (``syncd.engine.reference.make_tiny`` configs):

1. a trainer model is trained for a few real AdamW steps on text (so its next-token distributions are peaked,
   as a trained model's are; a random-init model's are flat), with NVFP4 QAT when ``nvfp4`` is set;
2. ``syncd.trainer.WeightPublisher`` publishes it as version 0 to the store (file or S3) and the same weights become
   the model folder a node serves;
3. a node (``syncd.engine.dynamo.serve.Node``: the Dynamo frontend and reference-engine workers recording replay
   records to the store) and a sandbox proxy (``python -m syncd.engine.proxy``, recording trajectories) start;
4. ``requests`` streamed completions (temperature, top-p, top-k as configured) run through the proxy, started
   together (sent to paused workers, resumed once they hold every one), while a controller makes ``updates``
   more real optimizer steps, publishing each as a delta and applying it on every worker through its admin
   routes once every stream has made ``update_every`` more tokens (the workers pause, in steps up to that
   point, while the trainer steps, publishes and they stage and apply): the streams carry on with the new
   weights, mid-trajectory, keeping their KV caches;
5. the proxy writes every trajectory, the workers flush their replay records, everything stops.

The returned :class:`RolloutRun` says where the records are and holds the weights each version served, as the
trainer's float32 state dict (bf16-rounded as published), for recomputation.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench._sse import sse_json
from bench._timing import Stopwatch

log = logging.getLogger("bench.rollouts")

SANDBOX = "sb-replay"
FALLBACK_TEXT = ("Every K optimizer steps the trainer computes a lossless, compressed weight delta and uploads it "
                 "to object storage; engines apply it in place and resume with their KV caches intact. ")


@dataclass(frozen=True)
class RolloutConfig:
    """What :func:`generate` runs. Sizes of the tiny model (``hidden``, ``layers``, ``experts``/``experts_top_k``
    for MoE archs), the load (``requests`` streams of ``max_tokens`` tokens, EOS ignored, ``concurrency`` running
    at once in the engine), sampling, and the training (``pretrain_steps`` before version 0; ``updates`` further
    steps published mid-trajectory, the k-th once a stream has made ``k * update_every`` tokens). ``kept_tolerance``:
    the workers record kept sets to rebuild within it (``--replay-kept-tolerance``; None lists every set)."""

    arch: str = "qwen2"
    nvfp4: bool = False
    hidden: int = 64
    layers: int = 2
    experts: int = 8
    experts_top_k: int = 2
    requests: int = 8
    max_tokens: int = 256
    concurrency: int = 8
    temperature: float = 1.0
    top_p: float = 0.8
    top_k: int = 20
    pretrain_steps: int = 60
    pretrain_lr: float = 1e-2
    updates: int = 2
    update_lr: float = 1e-3
    update_every: int = 40
    seed: int = 0
    kept_tolerance: float | None = None


@dataclass
class RolloutRun:
    store_url: str
    run_id: str
    config: RolloutConfig
    model_config: object
    weights: dict[int, dict[str, torch.Tensor]]
    trajectories: list[tuple[str, str]]
    applied_at: dict[int, list[int]] = field(default_factory=dict)  # version -> tokens per stream when applied
    tokens: int = 0
    wall_s: float = 0.0

    def weights_of(self, version: int) -> dict[str, torch.Tensor]:
        return self.weights[version]

    def trainer_model(self, version: int | None = None):
        """A fresh float32 trainer model (NVFP4 QAT enabled when the run served NVFP4) holding ``version``'s
        weights (the last version when None)."""
        from syncd.engine.reference.make_tiny import random_model

        model = random_model(self.model_config, self.config.seed)
        if self.config.nvfp4:
            from syncd.trainer.qat import enable_qat

            enable_qat(model)
        model.load_state_dict(self.weights[max(self.weights) if version is None else version])
        return model.eval()


def corpus_ids() -> list[int]:
    """Token ids of the project's docs (the tiny byte-level tokenizer), the text the model is trained on."""
    from tokenizers import Tokenizer

    from syncd.engine.reference.make_tiny import tokenizer_json

    docs = sorted((Path(__file__).resolve().parents[1] / "docs").glob("*.md"))
    text = "".join(p.read_text(errors="replace") for p in docs) or FALLBACK_TEXT * 50
    return Tokenizer.from_str(tokenizer_json()).encode(text).ids


def train_step(model, opt, data: torch.Tensor, gen: torch.Generator, *, batch: int = 16, length: int = 128) -> float:
    """One real AdamW step of next-token loss on random windows of ``data``."""
    starts = torch.randint(0, data.numel() - length - 1, (batch,), generator=gen)
    x = torch.stack([data[s:s + length + 1] for s in starts.tolist()])
    model.train()
    loss = model(input_ids=x[:, :-1], labels=x[:, 1:].contiguous()).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def _published(model, nvfp4: bool) -> dict:
    if nvfp4:
        from syncd.trainer.qat import export_nvfp4

        return export_nvfp4(model)
    return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}


def _served(model) -> dict:
    """The trainer's view of what the engine serves: every weight rounded to bf16 (QAT quantizes the rest)."""
    return {k: v.detach().to(torch.bfloat16).float() for k, v in model.state_dict().items()}


def _write_folder(out: Path, config, model, state: dict) -> Path:
    from safetensors.torch import save_file

    from syncd.engine.reference.make_tiny import special_ids, write_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    config.architectures = [type(model).__name__]
    config.save_pretrained(out)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    ids = special_ids()
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": ids["<|endoftext|>"],
                                                            "eos_token_id": ids["<|im_end|>"]}))
    write_tokenizer(out)
    return out


def _workers(node):
    from syncd.engines.client import RemoteAdapter

    return [RemoteAdapter(w["admin_url"]) for w in node.workers()]


def _stream(url: str, body: dict, tid: str, progress: list, k: int) -> dict:
    from syncd import http_client

    conn = http_client.connect(url, timeout_s=600)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}),
                     headers={"Content-Type": "application/json", "X-Syncd-Trajectory": tid})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"stream {tid}: HTTP {resp.status}: {resp.read()[:300]!r}")
        finish = None
        for line in resp:
            obj = sse_json(line, f"stream {tid}")
            if obj is None:
                continue
            # tokens, not chunks: the frontend merges tokens that do not complete a character into one chunk
            progress[k] += len(((obj.get("nvext") or {}).get("engine_data") or {}).get("token_ids") or [])
            for ch in obj.get("choices") or []:
                finish = ch.get("finish_reason") or finish
        return {"finish_reason": finish}
    finally:
        conn.close()


def _post(url: str, path: str, body: dict) -> dict:
    from syncd import http_client

    status, out = http_client.request_json("POST", url, path, body, timeout_s=120)
    if status != 200:
        raise RuntimeError(f"{path}: HTTP {status}: {out}")
    return out or {}


def _start_proxy(workdir: Path, upstream: str, store_url: str, run_id: str):
    from syncd.engine.proxy.procs import start_proxy

    return start_proxy(workdir, upstream, store_url, run_id, SANDBOX)

def _pretrained(cfg: RolloutConfig, mcfg):
    """Step 1: the trainer model (NVFP4 QAT when ``cfg.nvfp4``) after ``cfg.pretrain_steps`` AdamW steps on text;
    returns it with its optimizer (now at ``cfg.update_lr``), the token data and the generator for later steps."""
    from syncd.engine.reference.make_tiny import random_model

    model = random_model(mcfg, cfg.seed)
    if cfg.nvfp4:
        from syncd.trainer.qat import enable_qat

        enable_qat(model)
    data = torch.tensor(corpus_ids())
    gen = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.pretrain_lr)
    for _ in range(cfg.pretrain_steps):
        train_step(model, opt, data, gen)
    for group in opt.param_groups:
        group["lr"] = cfg.update_lr
    return model, opt, data, gen


def _start_streams(node, proxy_url: str, cfg: RolloutConfig, tids: list[str], progress: list[int]):
    """Step 4: one thread per trajectory streaming its completion through the proxy (``progress[k]``: tokens so
    far); returns the threads and the list their errors are appended to."""
    errors: list = []
    lines = [ln for ln in (Path(__file__).resolve().parents[1] / "README.md").read_text().splitlines()
             if len(ln) > 20] or [FALLBACK_TEXT]

    def run(k: int) -> None:
        body = {"model": node.config.model_name, "prompt": lines[k % len(lines)][:80], "max_tokens": cfg.max_tokens,
                "temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k, "seed": cfg.seed + k,
                "ignore_eos": True, "nvext": {"extra_fields": ["engine_data"]}}
        try:
            _stream(proxy_url, body, tids[k], progress, k)
        except Exception as exc:  # noqa: BLE001 -- reported by generate
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(cfg.requests)]
    for t in threads:
        t.start()
    return threads, errors


def _held(node) -> int:
    """The requests the node's workers hold: the sum of their generate endpoints' in-flight gauges (Dynamo's
    ``dynamo_component_inflight_requests`` on each worker's system port, ``/metrics``)."""
    from syncd import http_client

    total = 0
    for w in node.workers():
        reply = http_client.request("GET", w["admin_url"], "/metrics", timeout_s=30)
        if reply.status != 200:
            raise RuntimeError(f"{w['name']}: GET /metrics: HTTP {reply.status}")
        for line in reply.body.decode(errors="replace").splitlines():
            if line.startswith("dynamo_component_inflight_requests{") and 'dynamo_endpoint="generate"' in line:
                total += int(float(line.rsplit(" ", 1)[1]))
    return total


class _Pacer:
    """Step 4's control of the streams' pace through every worker's admin routes (one lease each, taken by the
    first pause, released by :meth:`close`).

    :meth:`start` sends the streams while the workers are paused (the engines queue them) and resumes them once
    the workers hold all ``cfg.requests`` (their in-flight gauges): the streams start on the same engine step and
    advance together (``cfg.concurrency`` of them at once). Sent to running engines, a stream whose request reached
    its worker late (a busy machine) started that much later, and the first ones could end before it had made
    ``update_every`` tokens.

    :meth:`pause_at` pauses the workers with every stream at ``target`` tokens or more. On a busy machine the
    clients see the tokens late and in bursts: a pause sent when the clients reached 16 tokens held engines at
    nearly 60, and one sent when they first had a token, engines that had already ended the streams. So the engines
    never run while the controller waits for the clients: they run in steps, a resume followed at once by a pause
    (an engine makes in a step only what it makes while those two calls go through). After a round of steps the
    controller waits until the clients have caught up with the held engines (no stream grows for a while). A
    round is one step until the clients have seen tokens from a step, then as many steps as should cover half the
    distance left to ``target`` at the most tokens a step has made."""

    def __init__(self, node, cfg: RolloutConfig, progress: list[int]):
        self.node, self.cfg, self.progress = node, cfg, progress
        self.engines = _workers(node)
        self.threads: list[threading.Thread] = []
        self.errors: list = []
        self.pause_s = 0.0  # the last pause's round trip

    def running(self) -> bool:
        return any(t.is_alive() for t in self.threads)

    def pause(self) -> None:
        t = time.monotonic()
        for e in self.engines:
            e.pause()
        self.pause_s = time.monotonic() - t

    def resume(self) -> None:
        for e in self.engines:
            e.resume()

    def close(self) -> None:
        for e in self.engines:
            try:
                e.release()
            except Exception as exc:  # noqa: BLE001 -- a worker gone with the failure being reported
                log.warning("%s: lease not released: %s", e, exc)

    def start(self, proxy_url: str, tids: list[str], timeout_s: float = 300.0) -> None:
        """Send the streams to the paused workers; resume them once they hold every stream (RuntimeError when they
        do not within ``timeout_s``); the streams' errors are appended to ``self.errors``."""
        self.pause()
        try:
            self.threads, self.errors = _start_streams(self.node, proxy_url, self.cfg, tids, self.progress)
            deadline = time.monotonic() + timeout_s
            while not self.errors and (held := _held(self.node)) < self.cfg.requests:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the workers hold {held} of the {self.cfg.requests} streams {timeout_s:.0f} s "
                                       "after they were sent")
                time.sleep(0.01)
        finally:
            self.resume()

    def caught_up(self, limit_s: float = 60.0) -> list[int]:
        """The streams' tokens once none has grown for five pause round trips (at least 50 ms): with the engines
        paused, what the clients have of every token made before the pause."""
        quiet = max(0.05, 5 * self.pause_s)
        last, since, end = list(self.progress), time.monotonic(), time.monotonic() + limit_s
        while time.monotonic() - since < quiet and time.monotonic() < end:
            time.sleep(quiet / 20)
            if self.progress != last:
                last, since = list(self.progress), time.monotonic()
        return last

    def pause_at(self, target: int) -> list[int]:
        """Pause the workers (running, just resumed) with every stream at ``target`` tokens or more, or every
        stream ended; returns the streams' tokens then."""
        self.pause()
        at, per_step = self.caught_up(), 0
        while min(at) < target and self.running():
            steps = max(1, (target - min(at)) // (2 * per_step)) if per_step else 1
            for _ in range(steps):
                self.resume()
                self.pause()
            before, at = min(at), self.caught_up()
            per_step = max(per_step, -(-(min(at) - before) // steps))
        return at


def _update_mid_trajectory(engines, trainer, pub, version: int, store_url: str, run_id: str, workdir: Path,
                           nvfp4: bool) -> dict:
    """Step 4, one version, with every worker paused (the streams held mid-trajectory, :meth:`_Pacer.pause_at`):
    the trainer (model, opt, data, gen) steps and publishes ``version``, which every worker stages and applies
    through its admin routes, as a node daemon does; resumed. Returns the served weights of ``version``.
    RuntimeError when a worker is not at ``version`` after applying it."""
    from syncd.cache import ShardCache
    from syncd.engines.update import Update
    from syncd.versions import cache_version

    model, opt, data, gen = trainer
    try:
        train_step(model, opt, data, gen)
        pub.publish(_published(model, nvfp4), version)
        pub.flush()
        served = _served(model)
        raw = cache_version(store_url, run_id, version, ShardCache(workdir / "cache"), signing_key=False)
        for e in engines:
            e.stage(Update.from_cache(raw, workdir / "cache"))
            e.apply()
            if e.version != version:
                raise RuntimeError(f"a worker is at version {e.version} after applying {version}")
    finally:
        for e in engines:
            e.resume()
    return served


def _finish_trajectories(proxy_url: str, tids: list[str]) -> None:
    """Step 5: every trajectory finished at the proxy; RuntimeError for one not written complete."""
    for tid in tids:
        reply = _post(proxy_url, f"/syncd/trajectories/{tid}/finish", {})
        if not reply.get("written") or reply.get("status") != "complete":
            raise RuntimeError(f"trajectory {tid}: {reply}")


def generate(workdir: Path, store_url: str, cfg: RolloutConfig, *, run_id: str | None = None) -> RolloutRun:
    """Run the rollouts (see the module docstring) in the steps above. ``store_url``: where versions, replay records
    and trajectory records go (file or S3 URL). Raises RuntimeError when a stream, an update or a process fails."""
    from syncd.procs import stop_process
    from syncd.engine.dynamo.node import Node, NodeConfig
    from syncd.engine.reference.make_tiny import model_config
    from syncd.trainer import WeightPublisher

    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    run_id = run_id or f"replay-{cfg.arch}{'-nvfp4' if cfg.nvfp4 else ''}"
    t0 = Stopwatch()
    mcfg = model_config(cfg.arch, hidden=cfg.hidden, layers=cfg.layers, intermediate=2 * cfg.hidden,
                        experts=cfg.experts, top_k=cfg.experts_top_k)
    trainer = _pretrained(cfg, mcfg)
    state0 = _published(trainer[0], cfg.nvfp4)  # step 2: version 0, and the folder the node serves
    model_dir = _write_folder(workdir / "model", mcfg, trainer[0], state0)
    weights = {0: _served(trainer[0])}
    pub = WeightPublisher(store_url, run_id, signing_key=False, full_every=1000,
                          dtype=None if cfg.nvfp4 else torch.bfloat16)
    pub.publish(state0, 0)
    pub.flush()
    node = Node(NodeConfig.recording(  # step 3
        model_dir, workdir, store_url=store_url, run_id=run_id, prefix="r",
        worker_args=("--max-batch", str(cfg.concurrency),
                     *(() if cfg.kept_tolerance is None else ("--replay-kept-tolerance", repr(cfg.kept_tolerance))))))
    proxy = None
    applied: dict[int, list[int]] = {}
    tids = [f"traj-{k:03d}" for k in range(cfg.requests)]
    progress = [0] * cfg.requests
    try:
        node.start()
        node.supervise(background=True)
        proxy, proxy_url = _start_proxy(workdir, node.frontend_url, store_url, run_id)
        pacer = _Pacer(node, cfg, progress)
        try:
            pacer.start(proxy_url, tids)
            for version in range(1, cfg.updates + 1):
                applied[version] = pacer.pause_at(version * cfg.update_every)
                weights[version] = _update_mid_trajectory(pacer.engines, trainer, pub, version, store_url, run_id,
                                                          workdir, cfg.nvfp4)
                log.info("version %d applied with %s tokens per stream", version, applied[version])
        finally:
            pacer.close()
        for t in pacer.threads:
            t.join(600)
        if pacer.errors:
            raise RuntimeError(f"{len(pacer.errors)} stream(s) failed: {pacer.errors[0]}")
        _finish_trajectories(proxy_url, tids)
    finally:
        pub.close()
        if proxy is not None:
            stop_process(proxy, 30)
        node.close()  # the workers drain and flush their replay records
    return RolloutRun(store_url, run_id, cfg, mcfg, weights, [(SANDBOX, t) for t in tids], applied,
                      sum(progress), t0.elapsed)
