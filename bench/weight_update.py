"""Weight-update benchmark: publish real optimizer-step versions of a small LM, then materialize them.

Trains a random-init Qwen2-style model (fp32 master weights, AdamW at an RL learning rate on a
policy-gradient loss), publishes every K-th step with ``syncd.trainer.WeightPublisher`` to a store, and then
reads every version back the way a recovering node does (full version, then one delta at a time). In the
same run and over the same weights it measures the baseline: uploading, downloading and loading each
version as a full safetensors file. Prints, per version, bytes uploaded against the full safetensors bytes
and the time of each stage; writes JSON (``--json``).

    python -m bench.weight_update                       # ~100M parameters, 8 versions, local store
    python -m bench.weight_update --model tiny          # seconds; what the test runs
    python -m bench.weight_update --store s3://bucket/x # any store URL (credentials from the environment)

Stages (seconds): ``step`` training step; ``publish`` time spent inside ``publish()`` = ``snapshot`` (the
copy) + ``stall`` (waiting for the previous upload); ``encode`` and ``upload`` run in the background;
``fetch``/``apply`` the read side; ``base_*`` the full-safetensors baseline.

End to end (``--e2e``, on by default): the same trainer snapshots are published again, one version at a
time, while a ``syncd`` node daemon (``syncd.daemon.NodeDaemon``, its default poll interval) keeps
``--engines`` in-process engines (``syncd.engine.StateDictEngine``) current. Per version: from ``publish()``
returning to every engine serving it (``e2e``), broken into ``encode``, ``upload`` (shards + manifest),
``poll`` (manifest committed to the daemon noticing it), ``download`` (into the node cache, verified),
``decode`` (staging on the engines while they serve), ``pause`` (longest engine pause: apply + checksum
check) and ``other`` (the rest: scheduling, the hint write, engines paused one after another). The
baseline runs the same with a full safetensors version every time (``full_every=1``).
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

from bench._report import Row, finish, output_flags
from bench._timing import Stopwatch

log = logging.getLogger("bench.weight_update")

MODELS = {
    # ~93M parameters: embeddings 2 x 20.5M, 12 layers x 4.3M
    "100m": dict(hidden=640, layers=12, heads=10, kv_heads=2, intermediate=1728, vocab=32000),
    "small": dict(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=704, vocab=8000),
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=512),
}


def build_model(name: str, seed: int, device: str) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from syncd.lazy import quiet_optional_imports

    quiet_optional_imports()
    c = MODELS[name]
    torch.manual_seed(seed)
    conf = Qwen2Config(hidden_size=c["hidden"], num_hidden_layers=c["layers"], num_attention_heads=c["heads"],
                       num_key_value_heads=c["kv_heads"], intermediate_size=c["intermediate"],
                       vocab_size=c["vocab"], max_position_embeddings=256, tie_word_embeddings=False)
    return Qwen2ForCausalLM(conf).float().to(device)


def pg_step(model, opt, gen, batch: int, seq: int) -> None:
    """One policy-gradient step: sample continuations from the model, +-1 advantages, REINFORCE loss."""
    vocab = model.config.vocab_size
    dev = next(model.parameters()).device
    x = torch.randint(0, vocab, (batch, seq), generator=gen).to(dev)
    logits = model(input_ids=x).logits.float()
    logp = torch.log_softmax(logits, -1)
    with torch.no_grad():
        actions = torch.multinomial(logp.exp().view(-1, vocab), 1, generator=gen if dev.type == "cpu" else None)
    adv = (torch.randint(0, 2, (batch, 1), generator=gen).to(dev).float() * 2 - 1)
    loss = -(adv * logp.view(-1, vocab).gather(1, actions).view(batch, seq)).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def train_and_publish(args, store, run_id: str) -> dict:
    """Step 1: warm-up steps with no publisher (the steps' baseline), then ``args.versions * args.every_k`` steps,
    each offered to ``WeightPublisher.publish``; the publisher drained. Returns the seconds of each step and publish
    call, the publisher's history, the trainer's final bf16 weights and, for ``--e2e``, the weights published."""
    from syncd.publish.publisher import WeightPublisher

    model = build_model(args.model, args.seed, args.device)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed)
    log.info("model %s: %.1fM parameters on %s; store %s run %s", args.model, n_params / 1e6, args.device,
             store.url, run_id)
    alone_s = []  # training steps with no publisher: what the background work is compared against
    for _ in range(args.warmup):
        sw = Stopwatch()
        pg_step(model, opt, gen, args.batch, args.seq)
        _sync(args.device)
        alone_s.append(sw.elapsed)
    pub = WeightPublisher(store, run_id, every_k=args.every_k, full_every=args.full_every,
                          shard_bytes=args.shard_mb << 20, signing_key=args.signing_key or False,
                          delta_format=args.delta_format)
    step_s, publish_s, snapshots = [], [], []
    for step in range(args.versions * args.every_k):
        sw = Stopwatch()
        pg_step(model, opt, gen, args.batch, args.seq)
        _sync(args.device)
        step_s.append(sw.lap())
        published = pub.publish(model, step)
        publish_s.append(sw.lap())
        if published and args.e2e:  # the very weights published, for the end-to-end replay
            snapshots.append({k: v.detach().to(torch.bfloat16).cpu().clone() for k, v in model.state_dict().items()})
    sw = Stopwatch()
    pub.close()
    return dict(params=n_params, step_s=step_s, step_alone_s=alone_s, publish_s=publish_s, drain_s=sw.elapsed,
                history={s.version: s for s in pub.history}, snapshots=snapshots,
                final={k: v.detach().to(torch.bfloat16).cpu() for k, v in model.state_dict().items()})


def read_back(args, store, run_id: str, history: dict) -> list[dict]:
    """Step 2: every version read back as a recovering node does (full, then one delta at a time), and the
    baseline over the very same weights: each version saved, uploaded, downloaded and loaded as one safetensors
    file (AssertionError if its round trip differs). Per version: bytes and seconds of every stage."""
    from safetensors.torch import load as st_load
    from safetensors.torch import save as st_save

    from syncd.versions import apply_delta, fetch_shards, list_versions, load_full

    rows, weights, prev = [], None, None
    for info in list_versions(store, run_id, signing_key=args.signing_key or False):
        m, st = info.manifest, history[info.version]
        sw = Stopwatch()
        shards = fetch_shards(store, run_id, m)
        fetch_s = sw.lap()
        if m.kind == "full":
            weights = load_full(m, shards)
        else:
            apply_delta(weights, prev, m, shards)
        apply_s = sw.lap()
        prev = m
        blob = st_save(weights)
        save_s = sw.lap()
        key = f"baseline/{run_id}/{m.version:012d}.safetensors"
        store.put(key, blob)
        upload_s = sw.lap()
        back = store.download(key)
        download_s = sw.lap()
        loaded = st_load(bytes(back))
        load_s = sw.lap()
        assert all(torch.equal(loaded[k].view(torch.uint8) if loaded[k].dim() else loaded[k],
                               weights[k].view(torch.uint8) if weights[k].dim() else weights[k])
                   for k in weights), "baseline round trip differs"
        rows.append(dict(version=m.version, kind=m.kind, step=m.step, bytes=st.uploaded_bytes,
                         base_bytes=len(blob), ratio=st.uploaded_bytes / len(blob),
                         snapshot=st.snapshot_s, stall=st.stall_s, encode=st.encode_s, upload=st.upload_s,
                         fetch=fetch_s, apply=apply_s, base_save=save_s, base_upload=upload_s,
                         base_fetch=download_s, base_load=load_s))
    store.delete([o.key for o in store.list(f"baseline/{run_id}/")])
    return rows


def _bit_exact(a: dict, b: dict) -> bool:
    """Every tensor of ``b`` equal in ``a``, bf16 compared as words."""
    word = lambda t: t.view(torch.int16) if t.dtype == torch.bfloat16 else t  # noqa: E731
    return all(torch.equal(word(a[k]), word(b[k])) for k in b)


def run(args) -> dict:
    """The measurements of the module docstring, in the steps above (the end-to-end case last); the JSON's dict."""
    import syncd
    from syncd.store import Store

    torch.set_flush_denormal(True)
    store = Store(args.store or Path(tempfile.mkdtemp(prefix="syncd-bench-")))
    run_id = args.run_id or f"bench-{uuid.uuid4().hex[:8]}"
    trained = train_and_publish(args, store, run_id)
    rows = read_back(args, store, run_id, trained["history"])
    sw = Stopwatch()
    latest = syncd.materialize(store, run_id, signing_key=args.signing_key or False)
    cold_s = sw.elapsed
    exact = _bit_exact(latest, trained["final"])
    e2e = None
    if args.e2e:
        e2e = {"engines": args.engines, "poll_interval_s": args.poll_interval_s,
               "delta": run_e2e(args, store, f"{run_id}-e2e", trained["snapshots"], args.full_every),
               "full": run_e2e(args, store, f"{run_id}-e2e-full", trained["snapshots"], 1)}
    return dict(model=args.model, params=trained["params"], device=args.device, store=store.url, lr=args.lr,
                every_k=args.every_k, full_every=args.full_every, shard_mb=args.shard_mb,
                delta_format=args.delta_format,
                machine=dict(python=platform.python_version(), torch=torch.__version__, cpus=os.cpu_count(),
                             torch_threads=torch.get_num_threads()),
                step_s=trained["step_s"], step_alone_s=trained["step_alone_s"], publish_s=trained["publish_s"],
                drain_s=trained["drain_s"], versions=rows, materialize_latest_s=cold_s, latest_bit_exact=exact,
                e2e=e2e)


def run_e2e(args, store, run_id: str, snapshots: list, full_every: int) -> dict:
    """Publish ``snapshots`` one version at a time while a node daemon keeps ``args.engines`` engines current;
    per version, the end-to-end lag and its parts (see the module docstring)."""
    import queue
    import shutil
    import threading

    from syncd import engine
    from syncd.daemon import DaemonConfig, NodeDaemon
    from syncd.publish.publisher import WeightPublisher

    key = args.signing_key or False
    cache_dir = Path(tempfile.mkdtemp(prefix="syncd-bench-cache-"))
    engines = {f"e{i}": engine.StateDictEngine({k: torch.zeros_like(v) for k, v in snapshots[0].items()}, None)
               for i in range(args.engines)}
    records: queue.Queue = queue.Queue()
    config = DaemonConfig(run_id=run_id, cache_dir=cache_dir, poll_interval_s=args.poll_interval_s)
    daemon = NodeDaemon(config, adapters=engines, store=store, signing_key=key, on_update=records.put)
    ready = threading.Event()
    loop_box = {}

    def serve():
        loop = _new_loop()
        loop_box["loop"] = loop
        ready.set()
        loop.run_until_complete(daemon.run())
        loop.close()

    thread = threading.Thread(target=serve, name="bench-daemon", daemon=True)
    thread.start()
    ready.wait()
    pub = WeightPublisher(store, run_id, full_every=full_every, shard_bytes=args.shard_mb << 20, signing_key=key,
                          delta_format=args.delta_format)
    rows = []
    phase = random.Random(args.seed)
    try:
        for i, snap in enumerate(snapshots):
            # a trainer is not in step with the daemon's polls: publish at a random point of the poll cycle
            time.sleep(phase.uniform(0, args.poll_interval_s))
            pub.publish(snap, i)
            t_ret = time.time()
            pause, got = {}, None
            deadline = time.monotonic() + 300
            while len(pause) < len(engines):
                try:
                    rec = records.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    raise RuntimeError(f"e2e: version {i} did not reach every engine within 300s") from None
                if rec["version"] == i:
                    got = got or rec
                    pause.update(rec["pause_s"])
                    got["done_at"] = max(got["done_at"], rec["done_at"])
            pub.flush()
            st = pub.history[-1]
            if i == 0:
                continue  # the engines' first load is a rebuild, not an update
            commit = t_ret + st.encode_s + st.upload_s
            parts = dict(encode=st.encode_s, upload=st.upload_s, poll=max(0.0, got["noticed_at"] - commit),
                         download=got["download_s"] or 0.0, decode=got["stage_s"], pause=max(pause.values()))
            e2e = got["done_at"] - t_ret
            rows.append(dict(version=i, kind=st.kind, bytes=st.uploaded_bytes, e2e=e2e, pause_sum=sum(pause.values()),
                             other=e2e - sum(parts.values()) - (sum(pause.values()) - parts["pause"]), **parts))
        exact = all(torch.equal(t.view(torch.int16) if t.dtype == torch.bfloat16 else t,
                                snapshots[-1][k].view(torch.int16) if t.dtype == torch.bfloat16 else snapshots[-1][k])
                    for e in engines.values() for k, t in e.state_dict().items())
    finally:
        loop_box["loop"].call_soon_threadsafe(daemon.request_stop)
        thread.join(timeout=60)
        pub.close()
        shutil.rmtree(cache_dir, ignore_errors=True)
    return {"full_every": full_every, "versions": rows, "engines_bit_exact": exact}


def _new_loop():
    import asyncio

    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:  # pragma: no cover
        return asyncio.new_event_loop()


def report_e2e(e2e: dict, out=None) -> None:
    w = (out or sys.stdout).write
    med = statistics.median
    d, f = e2e["delta"]["versions"], e2e["full"]["versions"]
    parts = ("encode", "upload", "poll", "download", "decode", "pause", "other")
    w(f"\nend to end: publish() returned -> all {e2e['engines']} engines serve the version (daemon poll interval "
      f"{e2e['poll_interval_s']}s); seconds\n")
    w(f"{'ver':>4} {'kind':5} {'bytes':>12} " + " ".join(f"{p:>8}" for p in parts) + f" {'e2e':>7} | "
      f"{'full st':>7} {'ratio':>6}\n")
    for r, b in zip(d, f):
        w(f"{r['version']:>4} {r['kind']:5} {r['bytes']:>12,} " + " ".join(f"{r[p]:8.3f}" for p in parts) +
          f" {r['e2e']:7.3f} | {b['e2e']:7.3f} {r['e2e'] / b['e2e']:6.2f}\n")
    deltas = [r for r in d if r["kind"] == "delta"] or d
    md, mf_ = med(r["e2e"] for r in deltas), med(r["e2e"] for r in f)
    w(f"median e2e lag: deltas {md:.3f}s vs full safetensors every version {mf_:.3f}s ({md / mf_:.2f}x); "
      f"pause median {med(r['pause'] for r in deltas):.3f}s = {med(r['pause'] / r['e2e'] for r in deltas):.1%} "
      f"of the lag (full: {med(r['pause'] for r in f):.3f}s); poll delay median "
      f"{med(r['poll'] for r in deltas):.3f}s (expected ~half the interval); engines bit-exact: "
      f"{e2e['delta']['engines_bit_exact'] and e2e['full']['engines_bit_exact']}\n")
    for name, rows in (("deltas", deltas), ("full", f)):
        w(f"  {name:6} median parts: " + ", ".join(f"{p} {med(r[p] for r in rows):.3f}" for p in parts) + "\n")


def report(res: dict, out=None) -> None:
    rows = res["versions"]
    w = (out or sys.stdout).write
    w(f"\nweight_update: {res['model']} ({res['params'] / 1e6:.1f}M params, bf16 {rows[0]['base_bytes'] / 1e6:.1f} MB)"
      f" on {res['device']}, lr {res['lr']:g}, K={res['every_k']}, full every {res['full_every']}, store {res['store']}\n")
    w(f"{'ver':>4} {'kind':5} {'bytes':>12} {'full st':>12} {'ratio':>7} | {'snap':>6} {'stall':>6} "
      f"{'encode':>7} {'upload':>7} | {'fetch':>6} {'apply':>6} | {'b.save':>7} {'b.up':>6} {'b.fetch':>7} "
      f"{'b.load':>7}\n")
    for r in rows:
        w(f"{r['version']:>4} {r['kind']:5} {r['bytes']:>12,} {r['base_bytes']:>12,} {r['ratio']:>6.2%} | "
          f"{r['snapshot']:6.3f} {r['stall']:6.3f} {r['encode']:7.3f} {r['upload']:7.3f} | {r['fetch']:6.3f} "
          f"{r['apply']:6.3f} | {r['base_save']:7.3f} {r['base_upload']:6.3f} {r['base_fetch']:7.3f} "
          f"{r['base_load']:7.3f}\n")
    deltas = [r for r in rows if r["kind"] == "delta"]
    total, base = sum(r["bytes"] for r in rows), sum(r["base_bytes"] for r in rows)
    med = statistics.median
    w(f"total uploaded {total:,} bytes vs {base:,} as full safetensors: {total / base:.2%}\n")
    if deltas:
        w(f"delta versions: median {med(r['bytes'] for r in deltas):,.0f} bytes = "
          f"{med(r['ratio'] for r in deltas):.2%} of full; background encode+upload median "
          f"{med(r['encode'] + r['upload'] for r in deltas):.3f}s vs baseline save+upload "
          f"{med(r['base_save'] + r['base_upload'] for r in deltas):.3f}s; read fetch+apply "
          f"{med(r['fetch'] + r['apply'] for r in deltas):.3f}s vs baseline fetch+load "
          f"{med(r['base_fetch'] + r['base_load'] for r in deltas):.3f}s\n")
    pub, snap = res["publish_s"], [r["snapshot"] for r in rows]
    alone = f" ({med(res['step_alone_s']):.3f}s with no publisher)" if res["step_alone_s"] else ""
    w(f"training step median {med(res['step_s']):.3f}s{alone}; publish() median {med(pub):.4f}s, max {max(pub):.4f}s "
      f"(snapshot copy median {med(snap):.4f}s, stall max {max(r['stall'] for r in rows):.4f}s); "
      f"close() drained in {res['drain_s']:.3f}s\n")
    w(f"materialize(latest) cold: {res['materialize_latest_s']:.3f}s; bit-exact with the trainer's bf16 weights: "
      f"{res['latest_bit_exact']}\n")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.weight_update", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="100m")
    p.add_argument("--versions", type=int, default=8, help="versions to publish")
    p.add_argument("--every-k", type=int, default=1)
    p.add_argument("--full-every", type=int, default=4)
    p.add_argument("--shard-mb", type=int, default=64)
    p.add_argument("--delta-format", type=int, choices=(1, 2), default=1, help="the deltas' codec format")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--store", default=None, help="store URL or path (default: a fresh temp dir)")
    p.add_argument("--run-id", default=None)
    p.add_argument("--signing-key", default=os.environ.get("SYNCD_SIGNING_KEY"))
    p.add_argument("--warmup", type=int, default=2, help="training steps timed before publishing starts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--e2e", action=argparse.BooleanOptionalAction, default=True,
                   help="end-to-end case: a node daemon keeping engines current (default on)")
    p.add_argument("--engines", type=int, default=2, help="engines the daemon keeps current (e2e)")
    p.add_argument("--poll-interval-s", type=float, default=0.5, help="the daemon's poll interval (e2e)")
    output_flags(p, "weight_update")
    return p


def rows(res: dict) -> list[Row]:
    """The shared columns: the delta versions' background encode+upload and read fetch+apply against the same
    weights as full safetensors files (refcheck: the materialized latest version bit-exact with the trainer's), and
    the end-to-end lag against a full version every time (refcheck: the engines bit-exact). Medians over the delta
    versions (over all versions when there are none)."""
    med = statistics.median
    vs = [r for r in res["versions"] if r["kind"] == "delta"] or res["versions"]
    sizes, dev = f"{res['params'] / 1e6:.1f}M params lr {res['lr']:g}", res["device"]
    pub, base_pub = med(r["encode"] + r["upload"] for r in vs), med(r["base_save"] + r["base_upload"] for r in vs)
    read, base_read = med(r["fetch"] + r["apply"] for r in vs), med(r["base_fetch"] + r["base_load"] for r in vs)
    table = [Row("publish: encode+upload", pub, base_pub / pub, "safetensors save+upload", sizes, dev),
             Row("read: fetch+apply", read, base_read / read, "safetensors fetch+load", sizes, dev,
                 res["latest_bit_exact"])]
    if res["e2e"]:
        e = res["e2e"]
        d = [r for r in e["delta"]["versions"] if r["kind"] == "delta"] or e["delta"]["versions"]
        lag, full = med(r["e2e"] for r in d), med(r["e2e"] for r in e["full"]["versions"])
        table.append(Row(f"e2e lag, {e['engines']} engines", lag, full / lag, "full safetensors every version",
                         sizes, "cpu", e["delta"]["engines_bit_exact"] and e["full"]["engines_bit_exact"]))
    return table


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.versions < 1 or args.every_k < 1:
        p.error("--versions and --every-k must be at least 1")
    res = run(args)
    report(res)
    if res["e2e"]:
        report_e2e(res["e2e"])
    return finish("weight_update", args, res, rows(res))


if __name__ == "__main__":
    sys.exit(main())
