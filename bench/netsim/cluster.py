"""A whole simulated deployment on shaped links (:class:`SimCluster`): a trainer that publishes, an object store, and
a cluster of nodes, each host in its own network namespace (:class:`~bench.netsim.netns.Netns`).

* ``tr``: the trainer, ``python -m bench.netsim.publisher`` (``syncd.trainer.WeightPublisher``), writing to
* ``st``: the object store, ``python -m bench.netsim s3serve --writable`` over a directory (it logs every byte
  it sends);
* ``n0`` .. ``n<N-1>``: one node each: a node daemon in cluster mode (``python -m syncd.app.cli --cluster-rank R``:
  its controller polls the store, the tree broadcast fills the node caches, the daemon stages and applies) and the
  engine it keeps current, a headless engine process (``python -m syncd.engine.control_server --headless``,
  ``syncd.engine.StateDictEngine``) on the namespace's loopback, starting from zeros (``WORKDIR/engine``); the
  daemon rebuilds it from the first full version.

:meth:`SimCluster.shape` puts the rates on the links: the trainer's upload, the store's egress (the long link
into the cluster: every byte the cluster reads from the store crosses it) and each node's link in both
directions. Each host's processes write their own records, which :meth:`SimCluster.timeline` reads back: the
publisher's line per version, each node's cluster events (``plan``, ``store_read``, ``delivered``) and each
daemon's status file (its update records: ``stage_s``, ``pause_s``, ``done_at``). Needs root and iproute2
(:func:`~bench.netsim.netns.netns_available`). A context manager: every process and namespace is gone on exit.
Used from one thread.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.netsim.netns import Lab, Netns
from bench.netsim.s3 import s3_env

__all__ = ["SimCluster", "RUN", "KEY"]

RUN = "simrun"
KEY = "bench-netsim-signing-key-0123456789"
ROOT = Path(__file__).resolve().parents[2]


class SimCluster(Lab):
    """``nodes`` nodes, a store and a trainer publishing ``params`` synthetic parameters (versions: a full one,
    then one delta per entry of ``densities``; see :mod:`bench.netsim.publisher`). ``poll_s``, ``heartbeat_s``,
    ``chunk_bytes``, ``fanout``, ``stall_s``: the nodes' cluster settings (``stall_s`` long: on a slow shaped link
    whose queue is one FIFO, TCP flows starve each other for seconds, which a fast link's flows do not, and a child
    would leave a starved but working parent); ``shard_bytes``, ``tensor_elems``,
    ``delta_format``: the publisher's. ``daemon_args``: extra daemon flags. ``queue_ms``: the shaped links' queue
    (:meth:`shape`)."""

    def __init__(self, workdir, nodes: int, *, params: int, densities, shard_bytes: int, tensor_elems: int = 1 << 22,
                 delta_format: int = 1, poll_s: float = 0.1, heartbeat_s: float = 0.5, chunk_bytes: int = 64 << 10,
                 fanout: int = 2, stall_s: float = 30.0, daemon_args=(), queue_ms: int = 1000):
        self.work = Path(workdir)
        self.n = nodes
        self.params, self.densities = params, list(densities)
        self.shard_bytes, self.tensor_elems, self.delta_format = shard_bytes, tensor_elems, delta_format
        self.poll_s, self.heartbeat_s, self.chunk_bytes, self.fanout = poll_s, heartbeat_s, chunk_bytes, fanout
        self.stall_s = stall_s
        self.daemon_args, self.queue_ms = list(daemon_args), queue_ms
        self.net = Netns(["st", "tr"] + [f"n{r}" for r in range(nodes)])
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.engine_urls: dict[int, str] = {}
        self.layout: dict | None = None

    # ------------------------------------------------------------------------------------------ start, stop

    @property
    def endpoint(self) -> str:
        return f"http://{self.net.ip('st')}:9000"

    def env(self) -> dict:
        token = self.work / "engine-token"
        return {**os.environ, **s3_env(), "AWS_ENDPOINT_URL": self.endpoint, "SYNCD_SIGNING_KEY": KEY,
                "SYNCD_ENGINE_TOKEN_FILE": str(token), "SYNCD_LOG_LEVEL": "WARNING",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}

    def spawn(self, name: str, host: str, args: list[str]) -> subprocess.Popen:
        """``python ARGS`` in ``host``'s namespace, its output in ``WORKDIR/NAME.log``."""
        with open(self.work / f"{name}.log", "ab") as log:
            p = subprocess.Popen([*self.net.exec_prefix(host), sys.executable, *args], cwd=ROOT, env=self.env(),
                                 stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.procs.append((name, p))
        return p

    def start(self) -> None:
        """Namespaces; then the store, the trainer, the engines (on port 9100 of their namespace's loopback) and the
        daemons all at once; returns once the store answers, the trainer's weights exist, the engines serve and
        every node sees every other."""
        from bench.netsim.publisher import write_engine_folder

        self.work.mkdir(parents=True, exist_ok=True)
        (self.work / "store").mkdir(exist_ok=True)
        write_engine_folder(self.work / "engine", self.params, self.tensor_elems)
        self.net.setup()
        ready = self.work / "store.ready"
        self.spawn("store", "st", ["-m", "bench.netsim", "s3serve", str(self.work / "store"), "--host",
                                   self.net.ip("st"), "--port", "9000", "--log", str(self.work / "store.log"),
                                   "--ready", str(ready), "--writable"])
        self.spawn("publisher", "tr", ["-m", "bench.netsim.publisher", "s3://simstore", RUN, str(self.work / "trainer"),
                                       "--endpoint", self.endpoint, "--params", str(self.params),
                                       "--densities", ",".join(map(str, self.densities)),
                                       "--tensor-elems", str(self.tensor_elems), "--shard-bytes", str(self.shard_bytes),
                                       "--delta-format", str(self.delta_format)])
        secret = self.work / "cluster.secret"
        secret.write_text("hex:" + secrets.token_hex(32))
        peers = ",".join(f"{r}={self.net.ip(f'n{r}')}:7400" for r in range(self.n))
        for r in range(self.n):
            self.engine_urls[r] = "http://127.0.0.1:9100"
            self.spawn(f"engine{r}", f"n{r}", ["-m", "syncd.engine.control_server", "--headless", "--model",
                                               str(self.work / "engine"), "--port", "9100",
                                               "--ready-file", str(self.work / f"engine{r}.ready")])
            self.spawn(f"daemon{r}", f"n{r}", [
                "-m", "syncd.app.cli", "--run-id", RUN, "--store", "s3://simstore", "--endpoint", self.endpoint,
                "--cache-dir", str(self.cache(r)), "--engine", f"e{r}={self.engine_urls[r]}",
                "--cluster-rank", str(r), "--cluster-peers", peers, "--cluster-secret-file", str(secret),
                "--cluster-heartbeat-s", str(self.heartbeat_s), "--cluster-poll-s", str(self.poll_s),
                "--cluster-chunk-bytes", str(self.chunk_bytes), "--cluster-fanout", str(self.fanout),
                "--cluster-stall-s", str(self.stall_s),
                "--cluster-no-fsync", "--cluster-events", str(self.events_path(r)), *self.daemon_args])
        self.wait(ready.exists, 60, "the store's S3 endpoint")
        layout = self.work / "trainer" / "ready.json"
        self.wait(layout.exists, 600, "the trainer's weights")
        self.layout = json.loads(layout.read_text())
        for r in range(self.n):
            self.wait((self.work / f"engine{r}.ready").exists, 600, f"engine {r} to serve")
        self.wait(lambda: all(any(len(e["live"]) == self.n for e in self.events(r, "live")) for r in range(self.n)),
                  120, "every node to see every other")

    def close(self) -> None:
        for _, p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for _, p in reversed(self.procs):
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        self.net.close()

    # ------------------------------------------------------------------------------------------ links

    def shape(self, *, upload_bps: float, long_bps: float, intra_bps: float) -> None:
        """The trainer's upload, the store's egress (the long link) and every node's link (both ways), each a token
        bucket of 2 ms of traffic (at least 3 packets), so that even a transfer of a few kB goes at the link's rate,
        with a queue of ``queue_ms`` (deep: at these low rates a shallow queue's drops stall TCP for whole seconds)."""
        burst = lambda bps: max(4500, int(bps / 8 * 0.002))  # noqa: E731
        q = self.queue_ms
        self.net.shape("tr", upload_bps, down=False, burst_bytes=burst(upload_bps), queue_ms=q)
        self.net.shape("st", long_bps, down=False, burst_bytes=burst(long_bps), queue_ms=q)
        for r in range(self.n):
            self.net.shape(f"n{r}", intra_bps, burst_bytes=burst(intra_bps), queue_ms=q)

    def unshape(self) -> None:
        for h in self.net.names:
            self.net.unshape(h)

    # ------------------------------------------------------------------------------------------ versions

    def publish(self, k: int, timeout: float = 600) -> dict:
        """Release the trainer's version ``k`` (see :mod:`bench.netsim.publisher`); its record once committed."""
        gates = self.work / "trainer" / "gates"
        gates.mkdir(exist_ok=True)
        (gates / str(k)).touch()
        return self.wait(lambda: self.published().get(k), timeout, f"the trainer to publish version {k}")

    def published(self) -> dict[int, dict]:
        """The trainer's records by ``k``."""
        try:
            lines = (self.work / "trainer" / "published.jsonl").read_text().splitlines(keepends=True)
        except FileNotFoundError:
            return {}
        return {(r := json.loads(line))["k"]: r for line in lines if line.endswith("\n")}

    def wait_served(self, version: int, timeout: float = 600) -> None:
        """Until every daemon's status file records ``version`` applied on its engine."""
        self.wait(lambda: all(self.update(r, version) for r in range(self.n)), timeout,
                  f"version {version} on every engine")

    def cache(self, rank: int) -> Path:
        return self.work / f"cache{rank}"

    def events_path(self, rank: int) -> Path:
        return self.work / f"node{rank}.events"

    def events(self, rank: int, ev: str | None = None) -> list[dict]:
        try:
            lines = self.events_path(rank).read_text().splitlines(keepends=True)
        except FileNotFoundError:
            return []
        out = [json.loads(line) for line in lines if line.endswith("\n")]
        return [e for e in out if ev is None or e["ev"] == ev]

    def status(self, rank: int) -> dict:
        try:
            return json.loads((self.cache(rank) / f"status-{RUN}.json").read_text())
        except (FileNotFoundError, ValueError):
            return {}

    def update(self, rank: int, version: int) -> dict | None:
        """Daemon ``rank``'s update record of ``version`` once its engine serves it (a delta's ``pause_s`` set)."""
        for u in self.status(rank).get("updates", []):
            if u["version"] == version and u.get("done_at") and u["pause_s"]:
                return u
        return None

    def timeline(self, version: int) -> dict:
        """Wall times and durations of ``version`` from every process's own records: ``publish`` (the trainer's
        line), per node ``plan`` (first plan received), ``store_reads`` (``[t, bytes, secs]`` of each shard it read
        from the store), ``delivered`` (the cluster layer handed it to the daemon) and ``update`` (the daemon's
        record: ``stage_s``, ``pause_s``, ``apply_s``, ``done_at``)."""
        pub = next(r for r in self.published().values() if r["version"] == version)
        nodes = {}
        for r in range(self.n):
            ev = self.events(r)
            nodes[r] = {"plan": min(e["t"] for e in ev if e["ev"] == "plan" and e["v"] == version),
                        "store_reads": [[e["t"], e["bytes"], e["secs"]] for e in ev
                                        if e["ev"] == "store_read" and e["v"] == version],
                        "delivered": next(e["t"] for e in ev if e["ev"] == "delivered" and e["v"] == version),
                        "update": self.update(r, version)}
        return {"version": version, "publish": pub, "nodes": nodes}

    # ------------------------------------------------------------------------------------------ waiting

    def wait(self, pred, timeout: float, what: str, poll: float = 0.02):
        """Poll ``pred()`` until truthy (returned); ``RuntimeError`` with the log's end if a process failed,
        ``TimeoutError`` naming ``what`` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            got = pred()
            if got:
                return got
            dead = [(n, p.returncode) for n, p in self.procs if p.poll() not in (None, 0)]
            if dead:
                raise RuntimeError(f"{dead[0][0]} exited with {dead[0][1]} while waiting for {what}:\n"
                                   f"{self.log_tail(dead[0][0])}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
            time.sleep(poll)

    def log_tail(self, name: str, n: int = 3000) -> str:
        try:
            return (self.work / f"{name}.log").read_text(errors="replace")[-n:]
        except FileNotFoundError:
            return ""
