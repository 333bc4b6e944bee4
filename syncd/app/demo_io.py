"""What ``syncd demo --weights-only`` sends and shows: :class:`Client` keeps requests streaming to every engine the
whole time (and counts what was served and lost), :class:`Display` shows the progress."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path

__all__ = ["Client", "Display", "write_summary"]


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
                req = urllib.request.Request(url + "/generate", data=body, method="POST")
                with urllib.request.urlopen(req, timeout=120) as resp:
                    for line in resp:
                        ev = json.loads(line)
                        count += 1
                        versions[ev["version"]] = versions.get(ev["version"], 0) + 1
                        finish = ev["finish_reason"]
            except (OSError, ValueError) as exc:
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
                                     TextColumn("{task.completed:>4.0f}/{task.total:<4.0f}"),
                                     TextColumn("{task.fields[info]}"))
            except ImportError:
                pass
        if self.rich is not None:
            self.rich.start()
            self.t_step = self.rich.add_task("trainer step", total=steps, info="")
            self.t_eng = {e: self.rich.add_task(f"engine {e}", total=versions - 1, info="") for e in engines}
            self.t_upd = self.rich.add_task("updates", total=versions * len(engines), info="")

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
                self.rich.update(task, completed=v or 0, info=f"v{v} lag {e.get('lag')} {e.get('state', '')}")
            self.rich.update(self.t_upd, completed=sum(len(u["pause_s"]) for u in updates),
                             info=f"{upd} | requests {client.served} served, {client.lost} lost")
            return
        now = time.monotonic()
        if now - self._last_line < 2.0:
            return
        self._last_line = now
        engs = " ".join(f"{n} v{e.get('version')} lag {e.get('lag')}" for n, e in sorted(engines.items()))
        print(f"[demo] step {step}{'' if loss is None else f' loss {loss:.3f}'} | newest v{newest} | {engs} | "
              f"last update {upd} | requests {client.served} served, {client.lost} lost", flush=True)

    def close(self) -> None:
        if self.rich is not None:
            self.rich.stop()


def write_summary(summary: dict, path) -> None:
    """Write a demo's summary as JSON to ``path`` (its folder made) and say where."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(summary, indent=1))
    print(f"summary: {path}")
