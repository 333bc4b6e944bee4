"""What the demos send and show: :class:`Client` keeps requests streaming to every engine the whole time (and counts
what was served and lost, ``syncd demo --weights-only``), :class:`Display` shows its progress; for both demos
:func:`published_versions` reads what the trainer published (kind, size, time) back from the store,
:func:`delta_sizes` sums it up and :func:`plot_timeline` draws the timeline PNG (matplotlib). Their files:
:func:`demo_keys` makes the Ed25519 key pair the run is signed with (next to the store) and :func:`how_to_read` says
how to read the store with it; :func:`check_writable` refuses, before the work, an output a flag names that cannot
be written; :func:`work_dir` and :func:`finish_work_dir` make and clear the work directory (the pictures drawn into
it stay); :func:`add_common_flags` adds the flags both demos take."""

from __future__ import annotations

import http.client
import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

from syncd import http_client

__all__ = ["Client", "Display", "write_summary", "published_versions", "delta_sizes", "plot_timeline", "say",
           "run_demo", "add_common_flags",
           "demo_keys", "how_to_read", "work_dir", "finish_work_dir"]


def say(text: str) -> None:
    """One progress line of a demo, flushed at once (a person is watching)."""
    print(f"[demo] {text}", flush=True)


# ---------------------------------------------------------------------------------------------- files


def demo_keys(private: Path, public: Path) -> None:
    """The demo's Ed25519 key pair at ``private`` (the publisher's, mode 0600) and ``public`` (for the daemon, the
    engines and readers: ``--verify-key``), as ``syncd keygen`` writes them; a pair already there (a reused
    ``--dir``, whose store it signed) is kept."""
    from syncd.signing.keyfiles import write_keypair

    if private.exists() and public.exists():
        return
    if private.with_suffix("") != public.with_suffix("") or private.suffix != ".key" or public.suffix != ".pub":
        raise ValueError(f"a key pair is PREFIX.key and PREFIX.pub, not {private} and {public}")
    private.unlink(missing_ok=True)
    public.unlink(missing_ok=True)
    write_keypair(private.with_suffix(""))


def how_to_read(store: Path, run_id: str, public: Path, private: Path) -> str:
    """What to type to read a kept demo store: its versions are signed with the demo's key."""
    return (f"the store is signed with the demo's Ed25519 key (public {public}, private {private}); read it with "
            f"`syncd ls --store {store} --run-id {run_id} --verify-key {public}` (the same --verify-key for "
            "syncd verify and syncd materialize)")


def add_common_flags(p, *, plot: str, pictures: str, kept: str, timeout: float) -> None:
    """The flags both demos take: the deltas' format, and what :func:`run_demo` and the progress read (``--json``,
    ``--plot`` described by ``plot``, ``--dir`` and ``--keep``, whose folder holds ``kept`` and keeps the
    ``pictures`` by default, ``--plain``, ``--timeout`` with its default)."""
    p.add_argument("--delta-format", type=int, choices=(1, 2), default=2,
                   help="codec format of the deltas (the engines hold every tensor whole, so format 2 decodes)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the summary here")
    p.add_argument("--plot", default=None, metavar="PNG", help=plot)
    p.add_argument("--dir", default=None,
                   help=f"work directory, kept (by default a temp dir, removed after but for the {pictures})")
    p.add_argument("--keep", action="store_true", help=f"keep the temp work directory ({kept})")
    p.add_argument("--plain", action="store_true", help="plain progress lines even on a terminal")
    p.add_argument("--timeout", type=float, default=timeout, help="give up after this many seconds")


def run_demo(args, *, name: str, prefix: str, run, print_summary, failures=(RuntimeError,)):
    """The frame both demos run in: an output flag that cannot be written (``--json``, ``--plot``, ``--dir``) is
    refused before the work; ``run(args, work, interrupts)`` runs in a work folder (``prefix``) with every child
    stopped on Ctrl-C; its summary is printed (``print_summary``) and written to ``--json``. Returns
    ``(summary, None)``, or ``(None, exit status)``: 2 for an output that cannot be written, 130 after Ctrl-C, 1 for
    one of ``failures`` (its message printed after ``name``'s)."""
    from syncd.app.commands import check_writable
    from syncd.app.interrupts import Interrupts

    try:
        for flag in ("--json", "--plot", "--dir"):
            if getattr(args, flag[2:]):
                check_writable(getattr(args, flag[2:]), flag, folder=flag == "--dir")
    except ValueError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return None, 2
    with Interrupts() as interrupts:
        work = None
        try:
            work = work_dir(args, prefix)
            summary = run(args, work, interrupts)
            print_summary(summary)
            if args.json:
                write_summary(summary, args.json)
            return summary, None
        except KeyboardInterrupt:
            interrupts.stop_all()
            if work is not None:
                finish_work_dir(work, bool(args.dir or args.keep))
            return None, interrupts.report()
        except failures as exc:
            print(exc, file=sys.stderr)
            return None, 1


def work_dir(args, prefix: str) -> Path:
    """``--dir`` (made) or a new temporary folder."""
    if args.dir:
        work = Path(args.dir).expanduser().resolve()
        work.mkdir(parents=True, exist_ok=True)
        return work
    return Path(tempfile.mkdtemp(prefix=prefix))


def finish_work_dir(work: Path, kept: bool, outputs=()) -> None:
    """At a demo's end: a kept work dir (``--dir``, ``--keep``) stays whole; a temporary one is removed but for the
    ``outputs`` directly in it (the pictures drawn there), which stay where the summary says they are."""
    if kept or not work.exists():
        return
    stay = {Path(p).resolve() for p in outputs if p and Path(p).resolve().parent == work.resolve()}
    if not stay:
        shutil.rmtree(work, ignore_errors=True)
        return
    for entry in work.iterdir():
        if entry.resolve() in stay:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------- client


class Client:
    """Streams generation requests to the engines, round robin, from ``threads`` threads until stopped.
    A request is served when its stream ends with a finish reason, lost otherwise."""

    def __init__(self, urls: list[str], *, threads: int, max_tokens: int):
        self.urls, self.max_tokens = urls, max_tokens
        self.served = self.lost = self.tokens = 0
        self.by_version: dict = {}
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(threads)]

    def start(self) -> "Client":
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)

    def _loop(self, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            url = self.urls[(i + n) % len(self.urls)]
            n += 1
            body = json.dumps({"request_id": f"c{i}-{n}", "prompt_token_ids": [(7 * n + i) % 256, 1, 2, 3],
                               "max_tokens": self.max_tokens, "temperature": 0.8, "seed": n}).encode()
            finish, versions, count = None, {}, 0
            try:
                conn = http_client.connect(url, timeout_s=120)
                try:
                    conn.request("POST", "/generate", body=body, headers={"Content-Type": "application/json"})
                    for line in conn.getresponse():
                        ev = json.loads(line)
                        count += 1
                        versions[ev["version"]] = versions.get(ev["version"], 0) + 1
                        finish = ev["finish_reason"]
                finally:
                    conn.close()
            except (OSError, ValueError, http.client.HTTPException) as exc:
                with self._lock:
                    self.errors.append(f"{url}: {exc}")
            with self._lock:
                if finish in ("length", "stop"):
                    self.served += 1
                    self.tokens += count
                    for v, c in versions.items():
                        self.by_version[v] = self.by_version.get(v, 0) + c
                else:
                    self.lost += 1


# ---------------------------------------------------------------------------------------------- display


class Display:
    """Progress: rich bars on a terminal (when ``rich`` is installed), else a plain line every few seconds."""

    def __init__(self, versions: int, steps: int, engines: list[str], plain: bool):
        self.rich = None
        self._last_line = 0.0
        if not plain:
            try:
                from rich.progress import BarColumn, Progress, TextColumn

                self.rich = Progress(TextColumn("{task.description:<14}"), BarColumn(),
                                     TextColumn("{task.completed:>4.0f}{task.fields[of]:<5}"),
                                     TextColumn("{task.fields[info]}"))
            except ImportError:
                pass
        if self.rich is not None:
            self.rich.start()
            self.t_step = self.rich.add_task("trainer step", total=steps, info="", of=f"/{steps}")
            self.t_eng = {e: self.rich.add_task(f"engine {e}", total=versions - 1, info="", of=f"/{versions - 1}")
                          for e in engines}
            # a count, not a bar to fill: an engine that is behind skips to the newest version
            self.t_upd = self.rich.add_task("updates applied", total=None, info="", of="")

    def show(self, step, loss, status: dict, client: Client, updates: list) -> None:
        engines = status.get("engines", {})
        newest = status.get("newest_version")
        last = updates[-1] if updates else None
        upd = "-" if last is None else (f"v{last['version']} {last['kind']} {last['bytes'] / 1e3:.1f} kB, pause "
                                        + "/".join(f"{p * 1e3:.1f}" for p in last["pause_s"].values()) + " ms")
        if self.rich is not None:
            self.rich.update(self.t_step, completed=step, info="" if loss is None else f"loss {loss:.3f}")
            for name, task in self.t_eng.items():
                e = engines.get(name, {})
                v = e.get("version")
                self.rich.update(task, completed=v or 0, info=_engine_text(e))
            self.rich.update(self.t_upd, completed=sum(len(u["pause_s"]) for u in updates),
                             info=f"{upd} | requests {client.served} served, {client.lost} lost")
            return
        now = time.monotonic()
        if now - self._last_line < 2.0:
            return
        self._last_line = now
        engs = " ".join(f"{n} {_engine_text(e)}" for n, e in sorted(engines.items()))
        print(f"[demo] step {step}{'' if loss is None else f' loss {loss:.3f}'} | newest "
              f"{'-' if newest is None else f'v{newest}'} | {engs} | "
              f"last update {upd} | requests {client.served} served, {client.lost} lost", flush=True)

    def close(self) -> None:
        if self.rich is not None:
            self.rich.stop()


def _engine_text(e: dict) -> str:
    """``v5 lag 0 serving``, or ``starting`` before the daemon knows the engine's version."""
    if e.get("version") is None:
        return str(e.get("state") or "starting")
    return f"v{e['version']} lag {'-' if e.get('lag') is None else e['lag']} {e.get('state', '')}".rstrip()


def write_summary(summary: dict, path) -> None:
    """Write a demo's summary as JSON to ``path`` (its folder made) and say where."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(summary, indent=1))
    print(f"summary: {path}")


# ---------------------------------------------------------------------------------------------- the run's record


def published_versions(store, run_id: str, signing_key) -> list[dict]:
    """Every version of the run as the store holds it, oldest first: ``version``, ``kind``, ``bytes`` (shards),
    ``full_bytes`` (the same weights as safetensors), ``t`` (unix seconds, the manifest's creation time)."""
    from syncd.versions import list_versions

    out = []
    for info in list_versions(store, run_id, signing_key=signing_key):
        m = info.manifest
        if m is not None:
            out.append({"version": m.version, "kind": m.kind, "bytes": m.total_bytes,
                        "full_bytes": sum(t.nbytes for t in m.tensors), "t": m.created_datetime.timestamp()})
    return out


def delta_sizes(versions: list[dict]) -> dict:
    """``delta_bytes_median``, ``full_bytes`` and ``delta_fraction_median`` (a delta's size over the bf16 weights')
    of :func:`published_versions`; None where the run has no delta."""
    import statistics

    deltas = [v["bytes"] for v in versions if v["kind"] == "delta"]
    full = versions[0]["full_bytes"] if versions else None
    med = statistics.median(deltas) if deltas else None
    return {"delta_bytes_median": med, "full_bytes": full, "deltas": len(deltas),
            "delta_fraction_median": med / full if med is not None and full else None}


def plot_timeline(versions: list[dict], updates: list[dict], path, *, title: str) -> Path:
    """The timeline PNG: the trainer's versions (publish times) and each engine's version over wall time, with a
    tick per pause (its length in ms, below). ``updates``: the daemon's status records (``done_at``,
    ``version``, ``pause_s`` per engine, ``rebuild_from``). Raises ImportError naming the extra without
    matplotlib."""
    from syncd.plotting import pyplot, save_figure

    plt = pyplot("the timeline")
    t0 = min([v["t"] for v in versions] + [u["done_at"] for u in updates if u.get("done_at")] or [0.0])
    fig, (top, low) = plt.subplots(2, 1, figsize=(9, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    if versions:
        top.step([v["t"] - t0 for v in versions], [v["version"] for v in versions], where="post", linewidth=2.5,
                 color="black", label="trainer (published)")
    engines = sorted({e for u in updates for e in u.get("pause_s", {})})
    for i, name in enumerate(engines):
        mine = [u for u in updates if name in u.get("pause_s", {}) and u.get("done_at")]
        color = f"C{i}"
        top.step([u["done_at"] - t0 for u in mine], [u["version"] for u in mine], where="post", color=color,
                 linestyle="--", label=f"engine {name} (serving)")
        live = [u for u in mine if u.get("rebuild_from") is None]
        low.vlines([u["done_at"] - t0 for u in live], 0, [u["pause_s"][name] * 1e3 for u in live], color=color,
                   label=f"{name}")
    top.set(ylabel="weight version", title=title)
    top.legend(loc="upper left", fontsize=8)
    low.set(xlabel="wall time (s)", ylabel="pause (ms)")
    low.legend(loc="upper right", fontsize=7, ncols=max(1, len(engines)))
    return save_figure(fig, path, dpi=90)
