"""Node processes of one simulated cluster (:class:`NodeProcs`): starts ``python -m syncd.cluster.node``
processes, or node daemons keeping engines current (``engines``: ``python -m syncd.app.cli`` in cluster mode),
optionally inside network namespaces; kills (SIGKILL) and restarts them, and reads their event logs.
Used from one thread.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["NodeProcs", "SCRUB_BYTES"]

#: engine weight bytes a simulated node's daemon scrubs at each of its engine checks (every 0.5 s)
SCRUB_BYTES = 64 << 20


class NodeProcs:
    """Node processes of one simulated cluster. ``addrs``: ``{rank: (host, port)}``; ``prefix``:
    ``{rank: argv prefix}`` (e.g. ``ip netns exec NS``); ``args``: extra flags for every node, in the node's
    spelling (``--heartbeat-s``). ``engines``: ``{rank: control URL}``: each node is then a daemon keeping that
    engine current (``--engine``; the node flags become its ``--cluster-*`` flags), with the same cache folder
    and event log."""

    def __init__(self, workdir, *, store: str, run_id: str, secret: str, signing_key: str | None,
                 addrs: dict, prefix: dict | None = None, args=(), env: dict | None = None,
                 log_level: str = "WARNING", discovery: str | None = None, engines: dict | None = None):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.addrs, self.prefix = dict(addrs), dict(prefix or {})
        self.secret_file = self.workdir / "cluster.secret"
        self.secret_file.write_text(secret)
        self.env = {**os.environ, **(env or {})}
        if signing_key:
            self.env["SYNCD_SIGNING_KEY"] = signing_key
        self.env.pop("SYNCD_CLUSTER_SECRET", None)
        self.discovery = discovery
        self.engines = dict(engines or {})
        members = (["--peers-from-store", discovery] if discovery else
                   ["--peers", ",".join(f"{r}={h}:{p}" for r, (h, p) in sorted(self.addrs.items()))])
        self.common = ["--store", store, "--run-id", run_id, "--log-level", log_level]
        self.node_flags = ["--cluster-secret-file", str(self.secret_file), *members, *args]
        self.procs: dict[int, subprocess.Popen] = {}
        self.extra: dict[int, list] = {}

    def cache(self, rank: int) -> Path:
        return self.workdir / f"node{rank}"

    def events_path(self, rank: int) -> Path:
        return self.workdir / f"node{rank}.events"

    def start(self, rank: int, extra=()) -> subprocess.Popen:
        self.extra[rank] = list(extra) or self.extra.get(rank, [])
        flags = [*self.node_flags, "--rank", str(rank), "--events", str(self.events_path(rank)), *self.extra[rank]]
        if self.discovery:
            flags += ["--advertise", "%s:%d" % self.addrs[rank]]
        if rank in self.engines:
            argv = [*self.prefix.get(rank, []), sys.executable, "-m", "syncd.app.cli", *self.common,
                    "--cache-dir", str(self.cache(rank)), "--engine", f"e{rank}={self.engines[rank]}",
                    "--engine-check-s", "0.5", "--engine-scrub-s", "0.5", "--engine-scrub-bytes", str(SCRUB_BYTES),
                    "--metrics-port", "0", *_as_daemon_flags(flags)]
        else:
            argv = [*self.prefix.get(rank, []), sys.executable, "-m", "syncd.cluster.node", *self.common,
                    "--cache-root", str(self.cache(rank)), *flags]
        errf = open(self.workdir / f"node{rank}.log", "ab")
        p = subprocess.Popen(argv, env=self.env, stdout=errf, stderr=errf, stdin=subprocess.DEVNULL)
        errf.close()
        self.procs[rank] = p
        return p

    def start_all(self) -> None:
        for r in sorted(self.addrs):
            self.start(r)

    def kill(self, rank: int, sig=signal.SIGKILL) -> None:
        p = self.procs.get(rank)
        if p is not None and p.poll() is None:
            p.send_signal(sig)
            p.wait(10)

    def stop_all(self) -> None:
        for r in list(self.procs):
            self.kill(r, signal.SIGTERM)

    def alive(self, rank: int) -> bool:
        p = self.procs.get(rank)
        return p is not None and p.poll() is None

    def events(self, rank: int, ev: str | None = None) -> list[dict]:
        out = []
        try:
            with open(self.events_path(rank)) as fh:
                for line in fh:
                    if line.endswith("\n"):
                        d = json.loads(line)
                        if ev is None or d["ev"] == ev:
                            out.append(d)
        except FileNotFoundError:
            pass
        return out

    def delivered(self, rank: int) -> list[int]:
        return [e["v"] for e in self.events(rank, "delivered")]

    def wait(self, pred, timeout: float, what: str, poll: float = 0.05):
        """Poll ``pred()`` until truthy (returned) or raise ``TimeoutError`` naming ``what``; also fails
        at once if a node that should be running died."""
        deadline = time.monotonic() + timeout
        while True:
            got = pred()
            if got:
                return got
            for r, p in self.procs.items():
                if p.poll() is not None and p.returncode not in (-9, -15, 0):
                    raise RuntimeError(f"node {r} exited with {p.returncode}: see {self.workdir}/node{r}.log")
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
            time.sleep(poll)

    def log_tail(self, rank: int, n: int = 4000) -> str:
        try:
            return (self.workdir / f"node{rank}.log").read_text()[-n:]
        except FileNotFoundError:
            return ""


def _as_daemon_flags(flags: list[str]) -> list[str]:
    """A node's flags as the daemon spells them: ``--heartbeat-s`` -> ``--cluster-heartbeat-s`` (the node's
    ``--cluster-secret-file`` already is)."""
    return [f"--cluster-{f[2:]}" if f.startswith("--") and not f.startswith("--cluster-") else f for f in flags]
