"""``syncd demo --weights-only``: weight sync on one machine, in about half a minute (plain ``syncd demo`` is the
RL run of ``syncd.app.rl_demo``).

A trainer process takes real AdamW steps on a tiny random-init model (``syncd.engine.reference.make_tiny``) and
publishes a version every ``--every-k`` steps with ``syncd.trainer.WeightPublisher`` to a local file store; two
reference-engine processes (``python -m syncd.engine.control_server``) serve generation; a ``syncd`` daemon process
keeps them on the newest version; a client in this process streams requests to both engines the whole time.
Progress shows the trainer's step and loss, each engine's version and lag, and each update's bytes and pause;
at the end a summary table is printed and written as JSON (``--json``): ``versions_applied``,
``requests_served``, ``requests_lost`` (must be 0), ``pause_s_median``/``pause_s_max``,
``bytes_per_version_median``, ``full_bytes`` and more. Exit status 0 when no request was lost and every
engine ended bit-exact (whole fp32 words) on the trainer's last version.

The run is signed with an Ed25519 key pair made next to the store in the work directory (the trainer gets the
private key, the daemon and the engines the public one; with ``--keep``/``--dir`` the demo prints how to read the
store); the timeline picture goes into the work directory too (kept at the end without ``--keep``). Outputs a flag
names that cannot be written are refused before the run (exit 2); Ctrl-C stops every process and exits 130
(:mod:`syncd.app.interrupts`).

    syncd demo --weights-only [--json PATH] [--versions N] [--every-k K] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from syncd.app.demo_io import (Client, Display, add_common_flags, delta_sizes, demo_keys, finish_work_dir,
                               how_to_read, plot_timeline, published_versions, run_demo, say)
from syncd.app.interrupts import Interrupts
from syncd.cli_help import HelpFormatter
from syncd.procs import wait_until

log = logging.getLogger(__name__)
RUN = "demo"


# ---------------------------------------------------------------------------------------------- trainer


def _trainer(argv) -> int:
    """The trainer process: ``python -m syncd.app.demo _trainer --model DIR --store URL --progress FILE ...``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from syncd.engine.reference.model import load_folder_weights
    from syncd.lazy import quiet_optional_imports
    from syncd.publish.publisher import WeightPublisher

    quiet_optional_imports()
    p = argparse.ArgumentParser(prog="syncd.app.demo _trainer")
    for name, kind in (("--model", str), ("--store", str), ("--progress", str), ("--versions", int),
                       ("--every-k", int), ("--full-every", int), ("--lr", float), ("--interval", float),
                       ("--delta-format", int)):
        p.add_argument(name, type=kind, required=True)
    a = p.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(a.model), dtype=torch.float32)
    model.load_state_dict({k: v.float() for k, v in load_folder_weights(a.model).items()})
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    gen = torch.Generator().manual_seed(0)
    out = open(a.progress, "a")

    def emit(**rec):
        out.write(json.dumps({"t": time.time(), **rec}) + "\n")
        out.flush()

    # the task: continue a counting sequence (token i+1 = token i + 1 mod 256); the loss falls visibly
    def batch():
        start = torch.randint(0, 256, (8, 1), generator=gen)
        return (start + torch.arange(32)) % 256

    pub = WeightPublisher(a.store, RUN, every_k=a.every_k, full_every=a.full_every, shard_bytes=64 << 10,
                          delta_format=a.delta_format)
    pub.publish(model, 0)
    emit(step=0, loss=None)
    step = 0
    for _ in range(a.versions - 1):
        t0 = time.monotonic()
        for _ in range(a.every_k):
            step += 1
            x = batch()
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        # the rest of an RL step (rollouts on the engines) is what the interval stands for
        time.sleep(max(0.0, a.interval - (time.monotonic() - t0)))
        pub.publish(model, step)
        emit(step=step, loss=float(loss))
    pub.close()
    emit(done=True, step=step, history=[{"version": s.version, "kind": s.kind, "bytes": s.uploaded_bytes,
                                         "full_bytes": s.full_bytes, "encode_s": s.encode_s,
                                         "upload_s": s.upload_s} for s in pub.history])
    return 0


# ---------------------------------------------------------------------------------------------- the run


def _spawn(args: list[str], env: dict, log_path: Path) -> subprocess.Popen:
    fh = open(log_path, "wb")
    try:
        return subprocess.Popen([sys.executable, *args], env=env, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
    finally:
        fh.close()


def _exited(children: dict) -> str | None:
    """Which children exited with an error, said in words (None: none did)."""
    dead = [n for n, p in children.items() if p.poll() not in (None, 0)]
    return f"{', '.join(dead)} exited" if dead else None


def _wait(cond, what: str, timeout: float, children: dict):
    try:
        return wait_until(cond, timeout, what, interval_s=0.05, alive=lambda: _exited(children),
                          not_yet=(OSError, ValueError, KeyError))
    except (TimeoutError, RuntimeError) as exc:
        raise RuntimeError(f"demo: {exc}") from None


def run(args, work: Path, interrupts: Interrupts) -> dict:
    """Run the demo in ``work``; returns the summary. RuntimeError when a part fails; KeyboardInterrupt (after
    stopping what it started) when ``interrupts`` says so."""
    from syncd.engines.client import RemoteAdapter
    from syncd.engine.reference.make_tiny import write_model
    from syncd.signing.keyfiles import read_public_key_file
    from syncd.versions import read_manifest

    kept = bool(args.dir or args.keep)
    say(f"weight sync on this machine: a trainer publishing {args.versions} versions (a full one every "
        f"{args.full_every}, deltas between), {args.workers} engine processes, the syncd daemon and {args.clients} "
        f"client threads streaming requests; work dir {work}"
        f"{'' if kept else ' (removed at the end but for the picture; --keep keeps it)'}")
    store, cache, logs = work / "store", work / "cache", work / "logs"
    logs.mkdir(exist_ok=True)
    store.mkdir(exist_ok=True)  # the daemon is a reader: it never creates a missing store
    private, public = work / "signing.key", work / "signing.pub"  # next to the store
    demo_keys(private, public)
    key = read_public_key_file(public, "the demo's public key")
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", SYNCD_LOG_LEVEL="INFO", SYNCD_VERIFY_KEYS=str(public),
               PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    for var in ("SYNCD_TEST_PAUSE_AT", "SYNCD_STORE", "SYNCD_RUN_ID", "SYNCD_ENGINES", "SYNCD_STATUS_FILE",
                "SYNCD_SIGNING_KEY", "SYNCD_SIGNING_KEY_FILE"):
        env.pop(var, None)
    t_start = time.time()
    children: dict[str, subprocess.Popen] = {}
    interrupts.watch(children.values)
    client = None
    display = None
    pictures: dict = {}
    try:
        say("writing a tiny random-init model and starting the engines and the trainer (each loads torch: the slow "
            "part)")
        model = write_model(work / "model", seed=args.seed)
        names = [f"e{i}" for i in range(args.workers)]
        for n in names:
            children[n] = _spawn(["-m", "syncd.engine.control_server", "--model", str(model), "--ready-file",
                                  str(work / f"{n}.ready")], env, logs / f"{n}.log")
        progress = work / "trainer.jsonl"
        children["trainer"] = _spawn(  # the publisher alone holds the private key
            ["-m", "syncd.app.demo", "_trainer", "--model", str(model), "--store", str(store), "--progress",
             str(progress), "--versions", str(args.versions), "--every-k", str(args.every_k), "--full-every",
             str(args.full_every), "--lr", str(args.lr), "--interval", str(args.interval), "--delta-format",
             str(args.delta_format)], {**env, "SYNCD_SIGNING_KEY_FILE": str(private), "SYNCD_VERIFY_KEYS": ""},
            logs / "trainer.log")
        urls = [_wait(lambda n=n: json.loads((work / f"{n}.ready").read_text())["url"], f"engine {n}", 180, children)
                for n in names]
        daemon_args = ["-m", "syncd.app.cli", "--run-id", RUN, "--store", str(store), "--cache-dir", str(cache),
                       "--poll-interval-s", "0.2", "--engine-check-s", "0.5", "--metrics-port", "0"]
        for n, u in zip(names, urls):
            daemon_args += ["--engine", f"{n}={u}"]
        say(f"engines up after {time.time() - t_start:.0f} s; starting the syncd daemon")
        children["daemon"] = _spawn(daemon_args, env, logs / "daemon.log")
        status_file = cache / f"status-{RUN}.json"
        remotes = [RemoteAdapter(u) for u in urls]
        _wait(lambda: all(r.version is not None for r in remotes), "the engines' first version", 180, children)
        client = Client(urls, threads=args.clients, max_tokens=args.max_tokens).start()
        plain = args.plain or not sys.stdout.isatty()
        display = Display(args.versions, (args.versions - 1) * args.every_k, names, plain)
        step, loss, done, history = 0, None, False, []
        final = (args.versions - 1)
        while True:
            if progress.exists():
                for line in progress.read_text().splitlines():
                    rec = json.loads(line)
                    step, loss = rec.get("step", step), rec.get("loss", loss)
                    if rec.get("done"):
                        done, history = True, rec["history"]
            status = json.loads(status_file.read_text()) if status_file.exists() else {}
            updates = status.get("updates", [])
            display.show(step, loss, status, client, updates)
            engines = status.get("engines", {})
            if done and engines and all(e.get("version") == final for e in engines.values()):
                break
            dead = _exited(children)
            if dead or time.time() - t_start > args.timeout:
                raise RuntimeError(f"demo: {dead or 'timed out'}; logs in {logs}")
            time.sleep(0.2)
        client.stop()
        display.close()
        display = None
        manifest = read_manifest(store, RUN, final, signing_key=key)
        want = {t.name: t.checksum for t in manifest.tensors}
        exact = all(r.checksum() == want for r in remotes)
        children["daemon"].send_signal(signal.SIGTERM)
        children["daemon"].wait(timeout=60)
        status = json.loads(status_file.read_text())
        versions = published_versions(store, RUN, key)
        if args.plot != "":
            try:
                drawn = plot_timeline(versions, status.get("updates", []),
                                      Path(args.plot).resolve() if args.plot else work / "syncd-demo-weights.png",
                                      title="syncd demo --weights-only: versions over time")
                pictures["timeline_png"] = str(drawn)
            except ImportError as exc:
                pictures["plot_error"] = str(exc)
        if kept:
            say(how_to_read(store, RUN, public, private))
        return {**summarize(args, status, history, client, exact, time.time() - t_start, work),
                **delta_sizes(versions), **pictures}
    finally:
        try:
            if client is not None:
                client._stop.set()
            if display is not None:
                display.close()
            for p in children.values():
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in children.values():
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait(timeout=10)
        finally:
            finish_work_dir(work, kept, [pictures.get("timeline_png")])


def summarize(args, status: dict, history: list, client: Client, exact: bool, wall_s: float, work: Path) -> dict:
    updates = status.get("updates", [])
    live = [u for u in updates if u.get("rebuild_from") is None]  # updates of serving engines, not rebuilds
    pauses = [p for u in live for p in u["pause_s"].values()]
    rebuilds = [p for u in updates if u.get("rebuild_from") is not None for p in u["pause_s"].values()]
    lags = [u["done_at"] - _ts(u["created_at"]) for u in live]
    published = [h["bytes"] for h in history]
    full = history[0]["full_bytes"] if history else 0
    med = statistics.median
    return {
        "versions_published": len(history),
        "versions_applied": len({u["version"] for u in updates}),
        "final_version": max((u["version"] for u in updates), default=None),
        "engines": len(status.get("engines", {})),
        "engines_bit_exact": exact,
        "requests_served": client.served,
        "requests_lost": client.lost,
        "tokens_served": client.tokens,
        "tokens_by_version": {str(k): v for k, v in sorted(client.by_version.items(),
                                                             key=lambda kv: -1 if kv[0] is None else kv[0])},
        "pause_s_median": med(pauses) if pauses else None,
        "pause_s_max": max(pauses) if pauses else None,
        "rebuild_pause_s_max": max(rebuilds) if rebuilds else None,
        "update_lag_s_median": med(lags) if lags else None,
        "bytes_per_version_median": med(published) if published else None,
        "delta_bytes_median": med([h["bytes"] for h in history if h["kind"] == "delta"] or [0]),
        "full_bytes": full,
        "compression": (med(published) / full) if published and full else None,
        "wall_s": wall_s,
        "versions": args.versions, "every_k": args.every_k, "full_every": args.full_every, "lr": args.lr,
        "delta_format": args.delta_format,
        "workdir": str(work) if (args.dir or args.keep) else None,
    }


def _ts(rfc3339: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()


def print_summary(s: dict) -> None:
    def f(x, unit=""):
        if x is None:
            return "-"
        return f"{x * 1e3:.1f} ms" if unit == "ms" else (f"{x:.2%}" if unit == "%" else f"{x:,.0f}")

    skipped = s["versions_published"] - s["versions_applied"]
    rows = [("versions published / applied", f"{s['versions_published']} / {s['versions_applied']}"
             + (f" ({skipped} never applied: an engine that is behind, or starts, goes straight to the newest "
                "version)" if skipped > 0 else "")),
            ("engines bit-exact with the trainer", str(s["engines_bit_exact"])),
            ("requests served / lost", f"{s['requests_served']:,} / {s['requests_lost']:,}"),
            ("tokens served", f(s["tokens_served"])),
            ("pause median / max", f"{f(s['pause_s_median'], 'ms')} / {f(s['pause_s_max'], 'ms')}"),
            ("publish -> serving lag (median)", f(s["update_lag_s_median"], "ms")),
            ("delta per version (median)", "-" if s.get("delta_bytes_median") is None else
             f"{s['delta_bytes_median'] / 1e3:,.1f} kB = {s['delta_fraction_median']:.1%} of the "
             f"{s['full_bytes'] / 1e3:,.1f} kB bf16 weights, format {s.get('delta_format', 1)}"),
            ("wall time", f"{s['wall_s']:.1f} s")]
    if s.get("timeline_png") or s.get("plot_error"):
        rows.append(("timeline", s.get("timeline_png") or f"not drawn: {s['plot_error']}"))
    if s.get("workdir"):
        rows.append(("work dir (kept)", f"{s['workdir']} (logs/, store/, cache/)"))
    try:
        from rich.console import Console
        from rich.table import Table

        if not sys.stdout.isatty():
            raise ImportError
        t = Table(title="syncd demo")
        t.add_column("")
        t.add_column("", justify="right")
        for k, v in rows:
            t.add_row(k, v)
        Console().print(t)
    except ImportError:
        width = max(len(k) for k, _ in rows)
        print("syncd demo summary")
        for k, v in rows:
            print(f"  {k:<{width}}  {v}")
    if (s.get("delta_fraction_median") or 0) > 0.05:
        print(f"  (About the delta size: a tiny random-init model at lr {s['lr']:g}, {s['every_k']} AdamW steps "
              "per version, changes most of its weights each version; the README's ~1% is what real RL settings "
              "give, a 100M model at lr 1e-6: `python -m bench.codec`. Try --lr 1e-7.)")


def build_parser(add_help: bool = True) -> argparse.ArgumentParser:
    """The demo's flags (also mounted as ``syncd demo`` by the CLI)."""
    p = argparse.ArgumentParser(prog="syncd demo --weights-only", description=__doc__.split("\n\n")[0].replace(
        "``", ""), add_help=add_help, formatter_class=HelpFormatter)
    p.add_argument("--versions", type=int, default=16, help="versions the trainer publishes")
    p.add_argument("--every-k", type=int, default=2, help="optimizer steps per version")
    p.add_argument("--full-every", type=int, default=8, help="a full version every that many, deltas between")
    p.add_argument("--lr", type=float, default=1e-5, help="the trainer's AdamW learning rate (the delta's size "
                                                          "follows it)")
    p.add_argument("--seed", type=int, default=0, help="seed of the tiny model's random init")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between versions (a real RL step's pace)")
    p.add_argument("--workers", type=int, default=2, help="engine processes (python -m syncd.engine.control_server)")
    p.add_argument("--clients", type=int, default=4, help="client threads streaming requests")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per request")
    add_common_flags(p, plot="the timeline (trainer's and engines' versions over time, pauses); '' for none "
                             "(default: syncd-demo-weights.png in the work directory)",
                     pictures="picture", kept="logs, store and its signing keys, cache", timeout=300)
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_trainer"]:
        return _trainer(argv[1:])
    p = build_parser()
    return run_main(p.parse_args(argv), p)


def run_main(args, p: argparse.ArgumentParser) -> int:
    """Run the demo for parsed ``args``; returns the exit status."""
    if args.versions < 2 or args.every_k < 1 or args.workers < 1 or args.clients < 1:
        p.error("--versions >= 2, --every-k >= 1, --workers >= 1, --clients >= 1")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    summary, status = run_demo(args, name="syncd demo --weights-only", prefix="syncd-demo-", run=run,
                               print_summary=print_summary)
    if summary is None:
        return status
    ok = (summary["requests_lost"] == 0 and summary["engines_bit_exact"]
          and summary["final_version"] == args.versions - 1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
