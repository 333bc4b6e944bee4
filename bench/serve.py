"""Serving-path benchmark: what the sandbox proxy and the Dynamo frontend cost, and what a migration costs.

Starts a real node (``syncd.engine.dynamo.serve.Node``: the Dynamo frontend and N reference-engine workers on a
tiny random-init model, file discovery) and a sandbox proxy (``python -m syncd.engine.proxy``), then, in the same
run, sends the same load (R requests of T generated tokens, C at a time, EOS ignored so every request makes
exactly T tokens) three ways:

* **direct**: to the same workers through Dynamo's own request plane (``Client.direct``, round robin, token ids in,
  no HTTP, no tokenizer) -- the baseline, and the physical limit of the path (the engines' speed);
* **frontend**: streamed OpenAI requests to the frontend (HTTP, tokenization, detokenization, routing);
* **proxy**: the same through the proxy (a second HTTP hop, token and version bookkeeping, record writes).

It prints requests/s and tokens/s for each with its ratio to direct, and per-request latency medians. Then
the **migration** cost: a streamed request whose worker is SIGKILLed after ``--kill-after`` tokens against the
same request undisturbed (same seed, so the same tokens), median of ``--migrations`` pairs; the extra time
is the latency of noticing the dead worker and re-running the prompt plus the tokens so far elsewhere.

    python -m bench.serve                       # 2 workers, 64 requests x 64 tokens, 8 at a time
    python -m bench.serve --preset tiny         # what the test runs (seconds)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from bench._report import Row, finish, output_flags
from bench._sse import sse_json
from bench._timing import Stopwatch

log = logging.getLogger("bench.serve")

PRESETS = {
    "default": dict(workers=2, requests=64, tokens=64, concurrency=8, repeats=3, migrations=3, kill_after=24,
                    migration_tokens=128, hidden=64, layers=2),
    "tiny": dict(workers=2, requests=6, tokens=8, concurrency=3, repeats=1, migrations=1, kill_after=6,
                 migration_tokens=40, hidden=32, layers=2),
}
RUN_ID = "bench-serve"


def _summary(latencies: list[float], wall: float, requests: int, tokens: int) -> dict:
    return {"wall_s": wall, "requests_per_s": requests / wall, "tokens_per_s": tokens / wall,
            "latency_median_s": statistics.median(latencies), "latency_max_s": max(latencies)}


async def _run_load(one, n: int, concurrency: int) -> tuple[list[float], float, int]:
    """Run ``one(i)`` (returns tokens made) n times, ``concurrency`` at a time; latencies, wall, tokens."""
    sem = asyncio.Semaphore(concurrency)
    lat: list[float] = []
    made = 0

    async def go(i):
        nonlocal made
        async with sem:
            t0 = Stopwatch()
            n = await one(i)  # (not `made += await ...`: that reads `made` before awaiting)
            made += n
            lat.append(t0.elapsed)

    t0 = Stopwatch()
    await asyncio.gather(*(go(i) for i in range(n)))
    return lat, t0.elapsed, made


async def _http_stream(session, url: str, body: dict, on_token=None) -> int:
    """Stream one completion; returns the tokens made (the final usage chunk's count). ``on_token(n, obj)``
    is called for each content chunk (the frontend may merge tokens whose text is incomplete)."""
    n, made = 0, None
    async with session.post(url, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {(await resp.text())[:300]}")
        async for line in resp.content:
            obj = sse_json(line, url)
            if obj is None:
                continue
            if obj.get("usage"):
                made = obj["usage"]["completion_tokens"]
            if obj.get("choices"):
                n += 1
                if on_token is not None:
                    on_token(n, obj)
    if made is None:
        raise RuntimeError(f"{url}: no usage chunk")
    return made


async def _direct_client(settings, namespace: str):
    from dynamo.runtime import DistributedRuntime

    settings.apply()
    runtime = DistributedRuntime(asyncio.get_running_loop(), settings.discovery, settings.request_plane)
    client = await runtime.endpoint(f"{namespace}.backend.generate").client()
    await client.wait_for_instances()
    return runtime, client


async def _measure(node, proxy_url: str, cfg: dict, prompt_ids: list[int], model: str) -> dict:
    import aiohttp

    T = cfg["tokens"]
    results = {}
    runtime, client = await _direct_client(node.settings, node.settings.namespace)

    live = [w["instance_id"] for w in node.workers()]  # the raw client does not skip dead, still-listed ones

    async def direct(i):
        req = {"token_ids": prompt_ids, "stop_conditions": {"max_tokens": T},
               "sampling_options": {"temperature": 1.0, "seed": i}, "eos_token_ids": []}
        n = 0
        async for item in await client.direct(req, live[i % len(live)]):
            n += len(item.data()["token_ids"])
        return n

    body = lambda i: {"model": model, "prompt": "benchmark prompt", "max_tokens": T, "seed": i,  # noqa: E731
                      "temperature": 1.0, "ignore_eos": True}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        paths = {"direct": direct,
                 "frontend": lambda i: _http_stream(session, f"{node.frontend_url}/v1/completions", body(i)),
                 "proxy": lambda i: _http_stream(session, f"{proxy_url}/v1/completions", body(i))}
        await _run_load(paths["direct"], cfg["concurrency"], cfg["concurrency"])  # warm-up
        runs = {k: [] for k in paths}
        for _ in range(cfg["repeats"]):
            for name, one in paths.items():  # interleaved, so drift in machine load hits all three alike
                lat, wall, made = await _run_load(one, cfg["requests"], cfg["concurrency"])
                if made != cfg["requests"] * T:
                    raise RuntimeError(f"{name}: {made} tokens made, expected {cfg['requests'] * T}")
                runs[name].append(_summary(lat, wall, cfg["requests"], made))
        for name, rs in runs.items():
            best = sorted(rs, key=lambda r: r["tokens_per_s"])[len(rs) // 2]  # the median run
            results[name] = {**best, "runs": rs}
        # last: killed workers stay listed (etcd lease ~30 s) and would slow the loads above
        results["migration"] = await _migrations(node, session, proxy_url, cfg, model)
    runtime.shutdown()
    return results


async def _migrations(node, session, proxy_url: str, cfg: dict, model: str) -> dict:
    pairs = []
    for k in range(cfg["migrations"]):
        body = {"model": model, "prompt": "a migrating request", "max_tokens": cfg["migration_tokens"],
                "seed": 1000 + k, "temperature": 1.0, "ignore_eos": True}
        await _wait_workers(node)
        await _wait_routable(session, node, model)
        t0 = Stopwatch()
        n_calm = await _http_stream(session, f"{proxy_url}/v1/completions", body)
        calm = t0.elapsed
        killed = {}

        def kill(n, obj):
            if n == cfg["kill_after"] and not killed:
                wid = obj["nvext"]["worker_id"]["decode_worker_id"]
                w = next(w for w in node.workers() if w["instance_id"] == wid)
                killed.update(w, at=time.perf_counter())
                os.kill(w["pid"], signal.SIGKILL)

        t0 = Stopwatch()
        n_hurt = await _http_stream(session, f"{proxy_url}/v1/completions",
                                    {**body, "nvext": {"extra_fields": ["worker_id"]}}, on_token=kill)
        hurt = t0.elapsed
        if not killed or n_hurt != n_calm:
            raise RuntimeError(f"migration {k}: killed={bool(killed)}, {n_hurt} tokens vs {n_calm} undisturbed")
        pairs.append({"undisturbed_s": calm, "migrated_s": hurt, "extra_s": hurt - calm})
    return {"tokens": cfg["migration_tokens"], "kill_after": cfg["kill_after"], "pairs": pairs,
            "extra_median_s": statistics.median(p["extra_s"] for p in pairs),
            "undisturbed_median_s": statistics.median(p["undisturbed_s"] for p in pairs)}


async def _wait_workers(node, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not node.serving():
        if time.monotonic() > deadline:
            raise TimeoutError("workers did not come back after a kill")
        await asyncio.sleep(0.2)


async def _wait_routable(session, node, model: str, timeout_s: float = 60.0) -> None:
    """Until the frontend has routed a request to every current worker (a restarted worker is known to the
    frontend a little after it sees itself in discovery)."""
    seen: set = set()
    deadline = time.monotonic() + timeout_s
    while not (want := {w["instance_id"] for w in node.workers()}) <= seen:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the frontend routed only to {seen} of {want}")
        async with session.post(f"{node.frontend_url}/v1/completions", json={
                "model": model, "prompt": "ping", "max_tokens": 1, "nvext": {"extra_fields": ["worker_id"]}}) as r:
            if r.status == 200:
                seen.add((await r.json())["nvext"]["worker_id"]["decode_worker_id"])
            else:
                await asyncio.sleep(0.2)


def _prompt_ids(frontend: str, model: str) -> list[int]:
    """The token ids the frontend makes of the benchmark prompt (so direct requests see the same prompt)."""
    from syncd import http_client

    text = http_client.request("POST", frontend, "/v1/completions", body=json.dumps({
        "model": model, "prompt": "benchmark prompt", "max_tokens": 1, "stream": True,
        "nvext": {"annotations": ["token_ids"]}}).encode(), headers={"Content-Type": "application/json"},
        timeout_s=60).body.decode()
    for block in text.split("\n\n"):
        if block.startswith("event: token_ids"):
            return json.loads(json.loads(block.split("\n", 1)[1].lstrip(":").strip()))
    raise RuntimeError(f"no token_ids annotation from the frontend: {text[:300]}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="default")
    for k in PRESETS["default"]:
        p.add_argument("--" + k.replace("_", "-"), type=int, default=None)
    p.add_argument("--discovery", choices=("etcd", "file"), default="etcd",
                   help="etcd: etcd + NATS started for the run (the production path); file: file discovery")
    p.add_argument("--log-level", default="WARNING")
    output_flags(p, "serve")
    return p


def rows(results: dict, cfg: dict) -> list[Row]:
    """The shared columns: every path's median request latency (ratio: its tokens/s over the direct client's), and
    the extra seconds of a stream whose worker is killed (against the undisturbed stream)."""
    d = results["direct"]["tokens_per_s"]
    sizes = f"{cfg['requests']} req x {cfg['tokens']} tok, {cfg['concurrency']} at once"
    table = [Row(f"{name} (latency p50)", results[name]["latency_median_s"], results[name]["tokens_per_s"] / d,
                 "direct to the workers (tok/s)", sizes) for name in ("direct", "frontend", "proxy")]
    m = results["migration"]
    table.append(Row("migration (extra seconds)", m["extra_median_s"], None, "", f"{m['tokens']} tok stream"))
    return table


def main(argv=None) -> int:
    saved = dict(os.environ)  # the direct client sets Dynamo's variables in this process; don't leak them
    try:
        return _main(argv)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _main(argv=None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper())
    cfg = dict(PRESETS[args.preset])
    cfg.update({k: v for k, v in vars(args).items() if k in cfg and v is not None})

    from syncd.engine.dynamo.node import Node, NodeConfig
    from syncd.engine.dynamo.settings import DynamoSettings
    from syncd.engine.reference.make_tiny import write_model

    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        tmp = Path(tmp)
        model_dir = write_model(tmp / "tiny", hidden=cfg["hidden"], layers=cfg["layers"],
                                intermediate=2 * cfg["hidden"])
        store_url = (tmp / "store").resolve().as_uri()
        (tmp / "store").mkdir()
        node = Node(NodeConfig(model=model_dir, run_dir=tmp / "node", workers=cfg["workers"], frontend=True,
                               migration_limit=3, start_services=args.discovery == "etcd",
                               settings=DynamoSettings(file_kv=tmp / "kv", namespace=f"b{uuid.uuid4().hex[:8]}"),
                               worker_args=("--weights-version", "0", "--max-batch", str(cfg["concurrency"]),
                                            "--replay-store", store_url, "--run-id", RUN_ID)))
        proxy = None
        try:
            node.start()
            node.supervise(background=True)
            proxy = _start_proxy(tmp, node.frontend_url, store_url)
            model = node.config.model_name
            results = asyncio.run(_measure(node, proxy[1], cfg, _prompt_ids(node.frontend_url, model), model))
        finally:
            if proxy is not None:
                from syncd.procs import stop_process

                stop_process(proxy[0], 30)
            node.close()

    d = results["direct"]["tokens_per_s"]
    print(f"serving path ({args.discovery} discovery): {cfg['workers']} reference-engine workers, {cfg['requests']} requests x {cfg['tokens']} "
          f"tokens, {cfg['concurrency']} at a time, median of {cfg['repeats']} runs")
    print(f"{'path':<10} {'req/s':>8} {'tok/s':>9} {'x direct':>9} {'latency p50 ms':>15}")
    for name in ("direct", "frontend", "proxy"):
        r = results[name]
        print(f"{name:<10} {r['requests_per_s']:8.2f} {r['tokens_per_s']:9.1f} {r['tokens_per_s'] / d:9.3f} "
              f"{1000 * r['latency_median_s']:15.1f}")
    m = results["migration"]
    print(f"migration: a {m['tokens']}-token stream whose worker is SIGKILLed after {m['kill_after']} tokens takes "
          f"{1000 * m['extra_median_s']:.0f} ms longer than undisturbed ({1000 * m['undisturbed_median_s']:.0f} ms), "
          f"median of {len(m['pairs'])}")
    out = {"bench": "serve", "preset": args.preset, "config": cfg, "discovery": args.discovery, "results": results,
           "python": sys.version.split()[0], "machine": platform.machine(), "cpus": os.cpu_count()}
    return finish("serve", args, out, rows(results, cfg))


def _start_proxy(tmp: Path, upstream: str, store_url: str):
    import subprocess

    from syncd.procs import wait_until

    ready = tmp / "proxy.json"
    proc = subprocess.Popen([sys.executable, "-m", "syncd.engine.proxy", "--upstream", upstream, "--store", store_url,
                             "--run-id", RUN_ID, "--sandbox-id", "bench", "--per-request", "--ready-file", str(ready)],
                            stdout=subprocess.DEVNULL, stderr=open(tmp / "proxy.log", "wb"), start_new_session=True)
    wait_until(ready.exists, 60, "the proxy to serve", alive=lambda: proc.poll() is not None and "proxy exited")
    return proc, json.loads(ready.read_text())["url"]


if __name__ == "__main__":
    sys.exit(main())
