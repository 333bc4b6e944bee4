"""One inference node's Dynamo processes as a library: :class:`NodeConfig` says what runs, :class:`Node` starts the
workers and the frontend, supervises them and stops them (``syncd serve``, :mod:`syncd.engine.dynamo.serve`, is its
command line; that module's docstring describes discovery, weights and supervision for operators).

Discovery: a node's file discovery is its own (``<run_dir>/discovery``) unless ``settings.file_kv`` names a folder to
share. Weights: with ``managed`` (default) a worker that exits is restarted without ``--weights-version``, so it
starts with weights of no version and registers only once the node daemon has loaded the newest version.
Supervision: a child that exits has what is left of its process group killed (each child runs in a session of
its own) and is restarted after a backoff (1 s doubling to 30 s); one that fails ``restart_limit`` times within ten
minutes stops the node. :meth:`Node.close` stops the workers first (SIGTERM: they leave discovery and drain), then
the frontend, then local services, and kills what is left after the grace period.

The node description (:meth:`Node.describe`, written atomically to the ready file once every worker is visible
through discovery and the frontend lists the model, rewritten after each restart) holds ``frontend`` (URL or
null), ``model``, ``workers`` (``name``, ``pid``, ``admin_url``, ``instance_id``, ``restarts``), the discovery
settings and the pid of the supervisor.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path

from syncd.engine.dynamo.procs import MAX_SYSTEM_PORT
from syncd.engine.dynamo.settings import DynamoSettings
from syncd.procs import free_port, http_json, port_taken, stop_process, wait_until

log = logging.getLogger(__name__)

__all__ = ["NodeConfig", "Node"]

RESTART_WINDOW_S = 600.0


@dataclass(frozen=True)
class NodeConfig:
    """What a node runs. ``workers``: worker processes; ``frontend``: start one (on ``http_port``, 0 picks a
    free port); ``system_port_base``: worker i's admin port is base + i (0: free ports); ``worker_args``:
    extra worker flags; ``run_dir``: ready files and logs (created), and the node's file discovery folder
    (``discovery``) unless ``settings.file_kv`` names one to share; ``start_services``: start etcd + NATS
    locally (etcd discovery); ``restart_limit``: failures of one child within ten minutes before the node
    gives up; ``startup_timeout_s``: how long the node may take to come up; ``stop_grace_s``: how long
    children get to stop before SIGKILL. ``managed``: a node daemon drives the workers, so a restarted worker
    starts without ``--weights-version`` and registers only once the daemon has loaded the newest version
    (False: it restarts with ``worker_args`` as they are). ``worker_env``: variables set for the workers only
    (e.g. ``SYNCD_VERIFY_KEYS``)."""

    model: Path
    run_dir: Path
    workers: int = 1
    frontend: bool = False
    http_host: str = "127.0.0.1"
    http_port: int = 0
    migration_limit: int = 3
    settings: DynamoSettings = field(default_factory=DynamoSettings)
    served_model_name: str | None = None
    system_port_base: int = 0
    worker_args: tuple[str, ...] = ()
    start_services: bool = False
    restart_limit: int = 5
    startup_timeout_s: float = 120.0
    stop_grace_s: float = 40.0
    ready_file: Path | None = None
    python: str = sys.executable
    managed: bool = True
    worker_env: dict = field(default_factory=dict)

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).resolve().name

    @classmethod
    def recording(cls, model, root, *, store_url: str, run_id: str, prefix: str = "n", worker_args=(),
                  **kw) -> "NodeConfig":
        """A frontend and ``workers`` (default 1) workers serving weights version 0 and recording their replay
        chunks into ``store_url`` under ``run_id``: discovery through files under ``root/kv`` in a namespace of
        its own (``prefix`` + 8 random hex digits), logs and ready files in ``root/node``. ``worker_args`` are
        appended; any other field is taken from ``kw`` (``startup_timeout_s`` defaults to 240 s: a cold start on
        two busy cores)."""
        import uuid

        root = Path(root)
        kw.setdefault("startup_timeout_s", 240)
        return cls(model=Path(model), run_dir=root / "node", frontend=True,
                   settings=DynamoSettings(file_kv=root / "kv", namespace=f"{prefix}{uuid.uuid4().hex[:8]}"),
                   worker_args=("--weights-version", "0", "--replay-store", store_url, "--run-id", run_id,
                                *worker_args), **kw)


@dataclass
class _Child:
    name: str
    argv: list[str]
    ready_file: Path | None
    admin_port: int | None = None
    proc: subprocess.Popen | None = None
    restarts: int = 0
    failures: deque = field(default_factory=deque)
    restart_at: float | None = None
    info: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)  # set over the node's environment for this child
    restart_argv: list[str] | None = None  # what a restart runs (None: argv)


class Node:
    """The processes of one node (see the module docstring). :meth:`start` brings them up and returns
    once they serve; :meth:`supervise` (a thread with ``background=True``) restarts what exits;
    :meth:`close` stops everything. Thread-safe for :meth:`close` against the supervision thread."""

    def __init__(self, config: NodeConfig):
        if config.workers < 0 or (config.workers == 0 and not config.frontend):
            raise ValueError("a node needs at least one worker or a frontend")
        self.config = config
        self.settings = config.settings
        self.services = None
        self.children: list[_Child] = []
        self.frontend_url: str | None = None
        self._lock = threading.RLock()
        self._closing = threading.Event()
        self._failed: str | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------------ start

    def start(self) -> "Node":
        cfg = self.config
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            if cfg.start_services:
                from syncd.engine.dynamo.services import LocalServices

                self.services = LocalServices(cfg.run_dir / "services").start()
                self.settings = replace(self.settings, discovery="etcd",
                                        etcd_endpoints=self.services.etcd_endpoints,
                                        nats_server=self.services.nats_server)
            if self.settings.discovery == "file" and self.settings.file_kv is None:
                self.settings = replace(self.settings, file_kv=cfg.run_dir / "discovery")  # this node's own
            self.settings = self.settings.resolved()
            self.check_ports()
            for i in range(cfg.workers):
                port = (cfg.system_port_base + i if cfg.system_port_base
                        else free_port(self.settings.host, below=MAX_SYSTEM_PORT))
                ready = cfg.run_dir / f"worker{i}.ready.json"
                argv = [cfg.python, "-m", "syncd.engine.dynamo.worker", "--model", str(cfg.model),
                        "--served-model-name", cfg.model_name, "--system-port", str(port),
                        "--ready-file", str(ready), *self.settings.argv(), *cfg.worker_args]
                again = _without_weights_version(argv) if cfg.managed else None
                self.children.append(_Child(f"worker{i}", argv, ready, port, restart_argv=again,
                                            env={**self._worker_env(i), **cfg.worker_env}))
            if cfg.frontend:
                port = cfg.http_port or free_port(cfg.http_host)
                self.frontend_url = f"http://{cfg.http_host}:{port}"
                argv = [cfg.python, "-m", "syncd.engine.dynamo.frontend", "--http-host", cfg.http_host,
                        "--http-port", str(port), "--migration-limit", str(cfg.migration_limit),
                        *self.settings.argv()]
                self.children.append(_Child("frontend", argv, None))
            for child in self.children:
                self._spawn(child)
            self.wait_ready(cfg.startup_timeout_s)
        except BaseException:
            self.close()
            raise
        self._write_ready_file()
        return self

    def check_ports(self) -> None:
        """ValueError naming the flag (``--http-port``, ``--system-port-base``) when a port the node was given
        cannot be listened on; :meth:`start` checks before it starts anything."""
        cfg = self.config
        if cfg.frontend:
            why = port_taken(cfg.http_host, cfg.http_port)
            if why:
                raise ValueError(f"--http-port {cfg.http_port}: the frontend cannot listen on {cfg.http_host}:"
                                 f"{cfg.http_port} ({why}); is another frontend running? Pick another port, or 0 "
                                 "for a free one")
        for i in range(cfg.workers if cfg.system_port_base else 0):
            port = cfg.system_port_base + i
            why = "above Dynamo's limit" if port > MAX_SYSTEM_PORT else port_taken(self.settings.host, port)
            if why:
                raise ValueError(f"--system-port-base {cfg.system_port_base}: worker{i}'s admin port {port} cannot "
                                 f"be used ({why}); pick another base, or 0 for free ports")

    def _worker_env(self, i: int) -> dict:
        """vLLM workers on CPU: each its own equal share of the cores (vLLM's automatic binding would put every
        worker's threads on the same cores), unless ``VLLM_CPU_OMP_THREADS_BIND`` is set."""
        args = list(self.config.worker_args)
        engine = args[args.index("--engine") + 1] if "--engine" in args[:-1] else os.environ.get("SYNCD_DYNAMO_ENGINE")
        if engine != "vllm" or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
            return {}
        from syncd.engine.vllm.ranks import cpu_shares

        try:
            return {"VLLM_CPU_OMP_THREADS_BIND": cpu_shares(self.config.workers)[i]}
        except ValueError as exc:  # more workers than cores: they share, as vLLM binds them
            log.warning("vLLM workers: %s", exc)
            return {}

    def _spawn(self, child: _Child) -> None:
        if child.ready_file is not None:
            child.ready_file.unlink(missing_ok=True)
        argv = child.restart_argv if child.restarts and child.restart_argv is not None else child.argv
        logf = open(self.config.run_dir / f"{child.name}.log", "ab")
        try:
            child.proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env={**self.settings.environ(), **child.env},
                                          start_new_session=True)
        finally:
            logf.close()
        child.info = {}
        log.info("started %s (pid %d)", child.name, child.proc.pid)

    def _log_tail(self, child: _Child, n: int = 3000) -> str:
        try:
            return (self.config.run_dir / f"{child.name}.log").read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def _child_ready(self, child: _Child) -> bool:
        if child.ready_file is not None:
            try:
                child.info = json.loads(child.ready_file.read_text())
                return True
            except (OSError, ValueError):
                return False
        status, body = http_json("GET", f"{self.frontend_url}/v1/models", timeout_s=2)
        if status != 200 or not isinstance(body, dict):
            return False
        names = {m.get("id") for m in body.get("data", [])}
        return self.config.workers == 0 or self.config.model_name in names

    def wait_ready(self, timeout_s: float) -> None:
        """Wait until every child serves; raises RuntimeError (a child exited) or TimeoutError."""
        for child in self.children:
            def exited(child=child):
                if child.proc.poll() is not None:
                    return f"{child.name} exited with status {child.proc.returncode}:\n{self._log_tail(child)}"
                return None
            wait_until(lambda child=child: self._child_ready(child), timeout_s, f"{child.name} to serve",
                       interval_s=0.1, alive=exited)

    # ------------------------------------------------------------------------------------ state

    def workers(self) -> list[dict]:
        """``name``, ``pid``, ``admin_url``, ``instance_id``, ``restarts`` of each worker."""
        with self._lock:
            return [{"name": c.name, "pid": c.proc.pid if c.proc else None,
                     "admin_url": f"http://{self.settings.host}:{c.admin_port}",
                     "instance_id": c.info.get("instance_id"), "restarts": c.restarts}
                    for c in self.children if c.ready_file is not None]

    def serving(self) -> bool:
        """True when every child runs (none exited or waiting for its restart) and every worker has
        announced itself through discovery since it last started."""
        with self._lock:
            return bool(self.children) and all(
                c.proc is not None and c.proc.poll() is None and c.restart_at is None
                and (c.ready_file is None or bool(c.info)) for c in self.children)

    @property
    def failed(self) -> str | None:
        """Why supervision stopped the node (a child failed too often), or None."""
        return self._failed

    @property
    def closing(self) -> bool:
        """True once :meth:`close` began (called, or supervision gave up)."""
        return self._closing.is_set()

    def describe(self) -> dict:
        s = self.settings
        return {"supervisor_pid": os.getpid(), "frontend": self.frontend_url, "model": self.config.model_name,
                "workers": self.workers(), "discovery": s.discovery, "namespace": s.namespace,
                "file_kv": str(s.file_kv) if s.file_kv else None, "etcd_endpoints": s.etcd_endpoints,
                "nats_server": s.nats_server}

    def _write_ready_file(self) -> None:
        path = self.ready_path
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.describe(), indent=2))
        os.replace(tmp, path)

    @property
    def ready_path(self) -> Path:
        """Where the node description is written (``ready_file``, else ``run_dir/node.json``)."""
        return Path(self.config.ready_file or self.config.run_dir / "node.json")

    # ------------------------------------------------------------------------------------ supervision

    def supervise(self, *, background: bool = False, interval_s: float = 0.2) -> str | None:
        """Restart children that exit until :meth:`close` (returns None) or a child fails too often
        (returns the reason, after stopping the node). ``background``: run in a daemon thread instead."""
        if background:
            self._thread = threading.Thread(target=self.supervise, name="dynamo-node-supervisor", daemon=True)
            self._thread.start()
            return None
        while not self._closing.wait(interval_s):
            with self._lock:
                if self._closing.is_set():
                    break
                reason = self._check_children()
            if reason:
                log.error("%s; stopping the node", reason)
                self._failed = reason
                self.close()
                return reason
        return None

    def _check_children(self) -> str | None:
        now = time.monotonic()
        changed = False
        for child in self.children:
            if child.restart_at is not None:
                if now >= child.restart_at:
                    child.restart_at = None
                    child.restarts += 1
                    self._spawn(child)
                continue
            if child.proc.poll() is None:
                if child.ready_file is not None and not child.info and self._child_ready(child):
                    changed = True
                continue
            child.info = {}  # its instance is gone; a restart announces a new one
            _kill_group(child.proc.pid)
            changed = True
            while child.failures and now - child.failures[0] > RESTART_WINDOW_S:
                child.failures.popleft()
            child.failures.append(now)
            if len(child.failures) > self.config.restart_limit:
                return (f"{child.name} failed {len(child.failures)} times in {RESTART_WINDOW_S:.0f} s (last exit "
                        f"status {child.proc.returncode}):\n{self._log_tail(child)}")
            delay = min(30.0, 2.0 ** (len(child.failures) - 1))
            log.warning("%s exited with status %s; restarting in %.0f s", child.name, child.proc.returncode, delay)
            child.restart_at = now + delay
        if changed:
            self._write_ready_file()
        return None

    # ------------------------------------------------------------------------------------ stop

    def close(self) -> None:
        """Stop workers (they drain), then the frontend, then local services. Idempotent."""
        self._closing.set()
        with self._lock:
            workers = [c for c in self.children if c.ready_file is not None and c.proc is not None]
            others = [c for c in self.children if c.ready_file is None and c.proc is not None]
            for c in workers:
                if c.proc.poll() is None:
                    try:
                        os.kill(c.proc.pid, signal.SIGTERM)
                    except ProcessLookupError:
                        pass
            for c in workers:
                stop_process(c.proc, self.config.stop_grace_s)
                _kill_group(c.proc.pid)
            for c in others:
                stop_process(c.proc, self.config.stop_grace_s)
                _kill_group(c.proc.pid)
            if self.services is not None:
                self.services.close()
                self.services = None
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(10)

    def __enter__(self) -> "Node":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def _without_weights_version(argv: list[str]) -> list[str]:
    """A worker's argv without ``--weights-version V`` (a restarted worker starts with weights of no version)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--weights-version":
            skip = True
        elif not a.startswith("--weights-version="):
            out.append(a)
    return out


def _kill_group(pgid: int) -> None:
    """SIGKILL what is left of a child's process group (the child led it: ``start_new_session``)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
