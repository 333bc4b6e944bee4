"""The serving side of a local RL run, started as real processes: what ``syncd demo``, ``bench.rl_loop`` and the
trainer's end-to-end tests run the thin trainer (``python -m syncd.trainer.run``) against.

* a tiny random-init model folder (``syncd.engine.reference.make_tiny``), which the engines serve as version 0;
* one inference node (``syncd.engine.dynamo.node.Node``, what ``syncd serve`` runs): the Dynamo frontend and
  ``engines`` reference-engine workers, each recording replay records to the store under the run;
* the sandbox proxy (``python -m syncd.engine.proxy``) in front of the frontend, recording trajectories;
* the node daemon (``python -m syncd.app.cli``), keeping every worker on the newest version through its admin
  routes and writing its status file (engines' versions, every update with its pauses).

Wiring: it imports ``engine`` and the syncd core, never ``trainer`` (the trainer is a process of its own, whose
command line :meth:`RLStack.trainer_argv` builds). Versions are signed with an Ed25519 key pair made for the stack
next to its store (``signing.key``, ``signing.pub`` in ``workdir``): the trainer's environment (:attr:`RLStack.env`)
carries the private key, the daemon and the engine workers get the public key only (``SYNCD_VERIFY_KEYS``), and
:attr:`RLStack.verify_key` reads what the trainer published.

Thread-safety: one owner thread; :meth:`close` is idempotent and stops everything it started.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

__all__ = ["StackConfig", "RLStack"]

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class StackConfig:
    """``workdir``: everything goes below it (model, store, logs, cache); ``store_url``: None for a file store
    in ``workdir``; ``engines``: Dynamo workers; ``engine``: what they run (``reference``, or ``vllm``: the model
    is then sized for vLLM's CPU attention, head_dim 64, and the workers get vLLM's flags only); the tiny model's
    ``arch``/``hidden``/``layers``/``seed``; ``max_batch``: requests one engine runs at once;
    ``poll_interval_s``: the daemon's poll of the store."""

    workdir: Path
    run_id: str = "rl"
    engines: int = 2
    engine: str = "reference"
    arch: str = "qwen2"
    hidden: int = 64
    layers: int = 2
    seed: int = 0
    store_url: str | None = None
    max_batch: int = 16
    poll_interval_s: float = 0.1
    sandbox_id: str = "rl-sandbox"
    startup_timeout_s: float = 240.0
    max_model_len: int = 512  # vLLM's (its KV cache is sized for it)

    def model_sizes(self) -> dict:
        """``write_model``'s sizes: vLLM's CPU attention needs head_dim 64 (2 heads of 64, one KV head)."""
        if self.engine == "vllm":
            return dict(hidden=2 * 64, heads=2, kv_heads=1, intermediate=4 * 64, layers=self.layers)
        return dict(hidden=self.hidden, layers=self.layers, intermediate=2 * self.hidden)

    def worker_args(self) -> tuple[str, ...]:
        """The engine workers' flags (beyond the replay store's): ``--threads`` is the reference engine's only."""
        if self.engine == "vllm":
            return ("--engine", "vllm", "--max-batch", str(self.max_batch), "--max-model-len", str(self.max_model_len))
        if self.engine != "reference":
            raise ValueError(f"engine must be 'reference' or 'vllm', got {self.engine!r}")
        return ("--max-batch", str(self.max_batch), "--threads", "1")


class RLStack:
    """Start with :meth:`start` (or ``with``); see the module docstring."""

    def __init__(self, config: StackConfig):
        self.config = config
        self.workdir = Path(config.workdir).resolve()
        self.store_url = config.store_url or (self.workdir / "store").as_uri()
        self.run_id = config.run_id
        self.model_dir = self.workdir / "model"
        self.logs = self.workdir / "logs"
        self.status_file = self.workdir / "daemon-status.json"
        self.private_key_file = self.workdir / "signing.key"
        self.public_key_file = self.workdir / "signing.pub"
        self.verify_key = None  # the public key (syncd.signing.PublicKey), once start() made the pair
        self.env = dict(os.environ, OMP_NUM_THREADS="1",
                        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        for var in ("SYNCD_STORE", "SYNCD_RUN_ID", "SYNCD_ENGINES", "SYNCD_STATUS_FILE", "SYNCD_TEST_PAUSE_AT",
                    "SYNCD_SIGNING_KEY", "SYNCD_SIGNING_KEY_FILE", "SYNCD_VERIFY_KEYS"):
            self.env.pop(var, None)
        self.reader_env = dict(self.env)  # the daemon's and the proxy's: no private key
        self.node = None
        self.proxy: subprocess.Popen | None = None
        self.proxy_url: str | None = None
        self.daemon: subprocess.Popen | None = None
        self.engines: dict[str, str] = {}  # worker name -> admin URL
        self.checked: dict[str, str] = {}  # worker name -> what engines_bit_exact compared

    # ------------------------------------------------------------------------------------ start

    def start(self, say=None) -> "RLStack":
        """Start everything; ``say(text)`` (if given) hears each stage as it begins."""
        say = say or (lambda text: log.info("%s", text))
        sizes = self.config.model_sizes()
        say(f"writing a tiny random-init {self.config.arch} model (hidden {sizes['hidden']}, {sizes['layers']} "
            f"layers) and starting the Dynamo frontend and {self.config.engines} {self.config.engine}-engine workers")
        from syncd.app.demo_io import demo_keys
        from syncd.engine.dynamo.node import Node, NodeConfig
        from syncd.engine.reference.make_tiny import write_model
        from syncd.signing.keyfiles import read_public_key_file

        cfg = self.config
        self.logs.mkdir(parents=True, exist_ok=True)
        demo_keys(self.private_key_file, self.public_key_file)
        self.verify_key = read_public_key_file(self.public_key_file, "the stack's public key")
        self.env["SYNCD_SIGNING_KEY"] = self.private_key_file.read_text().strip()  # the publisher's alone
        self.reader_env["SYNCD_VERIFY_KEYS"] = str(self.public_key_file)
        if self.store_url.startswith("file://"):
            Path(self.store_url[len("file://"):]).mkdir(parents=True, exist_ok=True)
        write_model(self.model_dir, arch=cfg.arch, seed=cfg.seed, **sizes)
        try:
            self.node = Node(NodeConfig.recording(
                self.model_dir, self.workdir, store_url=self.store_url, run_id=self.run_id, prefix="rl",
                workers=cfg.engines, worker_args=cfg.worker_args(),
                startup_timeout_s=cfg.startup_timeout_s,
                worker_env={"SYNCD_SIGNING_KEY": "", "SYNCD_SIGNING_KEY_FILE": "",
                            "SYNCD_VERIFY_KEYS": str(self.public_key_file)}))
            self.node.start()
            self.node.supervise(background=True)
            self.engines = {w["name"]: w["admin_url"] for w in self.node.workers()}
            say(f"engines {', '.join(self.engines)} up; starting the sandbox proxy and the syncd daemon")
            self.proxy, self.proxy_url = self._start_proxy()
            self.daemon = self._start_daemon()
        except BaseException:
            self.close()
            raise
        return self

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        with open(self.logs / f"{name}.log", "ab") as fh:
            return subprocess.Popen([sys.executable, *argv], env=self.reader_env, stdout=fh,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    def _start_proxy(self) -> tuple[subprocess.Popen, str]:
        from syncd.engine.proxy.procs import start_proxy

        proc, url = start_proxy(self.workdir, self.node.frontend_url, self.store_url, self.run_id,
                                self.config.sandbox_id, env=self.reader_env, log_path=self.logs / "proxy.log")
        self.proxy = proc
        return proc, url

    def _start_daemon(self) -> subprocess.Popen:
        from syncd.engines.client import RemoteAdapter
        from syncd.procs import wait_until

        argv = ["-m", "syncd.app.cli", "--run-id", self.run_id, "--store", self.store_url, "--cache-dir",
                str(self.workdir / "cache"), "--status-file", str(self.status_file), "--poll-interval-s",
                str(self.config.poll_interval_s), "--poll-jitter", "0", "--log-level", "INFO"]
        for name, url in self.engines.items():
            argv += ["--engine", f"{name}={url}"]
        proc = self._spawn("daemon", argv)
        remotes = [RemoteAdapter(u, timeout_s=10) for u in self.engines.values()]
        wait_until(lambda: all(r.version == 0 for r in remotes), 60, "the engines at version 0",
                   alive=lambda: proc.poll() is not None and f"the daemon exited ({self.log_tail('daemon')})")
        return proc

    # ------------------------------------------------------------------------------------ state

    def log_tail(self, name: str, n: int = 2000) -> str:
        try:
            return (self.logs / f"{name}.log").read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def daemon_status(self) -> dict:
        """The daemon's status file (``{}`` before its first write)."""
        try:
            return json.loads(self.status_file.read_text())
        except (OSError, ValueError):
            return {}

    def proxy_health(self) -> dict:
        """The proxy's ``/health`` (open trajectories, pending writes, failure counts); raises RuntimeError when it
        does not answer."""
        from syncd.procs import http_json

        status, body = http_json("GET", f"{self.proxy_url}/health", timeout_s=10)
        if status != 200 or not isinstance(body, dict):
            raise RuntimeError(f"the proxy's /health answered {status}: {body}")
        return body

    def engine_versions(self) -> dict[str, int | None]:
        """Each worker's version, asked through its admin route."""
        from syncd.engines.client import RemoteAdapter

        return {n: RemoteAdapter(u, timeout_s=30).version for n, u in self.engines.items()}

    def wait_engines_at(self, version: int, timeout_s: float = 120.0) -> None:
        """Until every worker serves ``version`` (TimeoutError otherwise)."""
        from syncd.procs import wait_until

        wait_until(lambda: all(v == version for v in self.engine_versions().values()), timeout_s,
                   f"every engine at version {version}", interval_s=0.2, alive=self.dead)

    def engines_bit_exact(self, version: int) -> dict[str, bool]:
        """Per worker: does every parameter it serves have the checksum version ``version`` gives it? Each engine's
        own parameters (:meth:`~syncd.engines.Adapter.parameters`): one that is a trainer tensor 1:1 against the
        manifest's checksum; fused or sliced ones (vLLM's ``qkv_proj``, ``gate_up_proj``) against the checksum of
        the same fusion built from the version's materialized (verified) tensors. What was checked, per worker, is
        in :attr:`checked` (a sentence)."""
        from syncd.engines.client import RemoteAdapter
        from syncd.engines.params import expected_checksums
        from syncd.versions import materialize, read_manifest

        m = read_manifest(self.store_url, self.run_id, version, signing_key=self.verify_key)
        manifest = {t.name: t.checksum for t in m.tensors}
        full = None
        out: dict[str, bool] = {}
        self.checked = {}
        for n, u in self.engines.items():
            remote = RemoteAdapter(u, timeout_s=60)
            specs = list(remote.parameters())
            want = expected_checksums(specs, manifest)
            fused = [s for s in specs if s.name not in want]
            if fused:
                if full is None:
                    full = materialize(self.store_url, self.run_id, version, signing_key=self.verify_key)
                want = expected_checksums(specs, full)
            got = remote.checksum(list(want))
            covered = {p.source for s in specs if s.name in want for p in s.pieces}
            out[n] = bool(want) and len(want) == len(specs) and all(got.get(k) == v for k, v in want.items())
            how = (f"{len(fused)} fused from several trainer tensors, checked against the same fusion of the "
                   "materialized version" if fused else "each a trainer tensor 1:1, against the manifest's checksum")
            self.checked[n] = (f"{len(want)} of its {len(specs)} parameters ({how}), covering "
                               f"{len(covered & set(manifest))} of the manifest's {len(manifest)} tensors")
        return out

    def processes(self) -> list[subprocess.Popen]:
        """Every process the stack started (running or not), each the leader of its own process group."""
        node = [c.proc for c in self.node.children] if self.node is not None else []
        return [p for p in (*node, self.proxy, self.daemon) if p is not None]

    def dead(self) -> str | None:
        """Why the stack cannot serve (a process exited), or None."""
        for name, p in (("proxy", self.proxy), ("daemon", self.daemon)):
            if p is not None and p.poll() is not None:
                return f"the {name} exited with status {p.returncode}: {self.log_tail(name)}"
        if self.node is not None and self.node.failed:
            return f"the node failed: {self.node.failed}"
        return None

    def trainer_argv(self, *extra: str, external_rollouts: bool = False) -> list[str]:
        """``python -m syncd.trainer.run`` against this stack, plus ``extra`` flags: with the rollout service in
        its process (``--proxy``), or reading the queue of ``syncd rollouts`` processes (``external_rollouts``)."""
        source = ["--external-rollouts"] if external_rollouts else ["--proxy", self.proxy_url]
        return [sys.executable, "-m", "syncd.trainer.run", *source, "--store", self.store_url,
                "--run-id", self.run_id, "--model", str(self.model_dir), "--daemon-status", str(self.status_file),
                *extra]

    def rollouts_argv(self, *extra: str) -> list[str]:
        """``python -m syncd.trainer.rl.rollout_service`` (``syncd rollouts``) against this stack's proxy and store,
        plus ``extra`` flags (the task and sampling flags must be the trainer's)."""
        vocab = json.loads((self.model_dir / "config.json").read_text())["vocab_size"]
        return [sys.executable, "-m", "syncd.trainer.rl.rollout_service", "--proxy", self.proxy_url, "--store",
                self.store_url, "--run-id", self.run_id, "--vocab-size", str(vocab), "--log-level", "INFO", *extra]

    # ------------------------------------------------------------------------------------ stop

    def stop_daemon(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM the daemon and wait (its status file is final afterwards)."""
        if self.daemon is None or self.daemon.poll() is not None:
            return None if self.daemon is None else self.daemon.returncode
        self.daemon.send_signal(signal.SIGTERM)
        try:
            return self.daemon.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.daemon.kill()
            return self.daemon.wait()

    def close(self) -> None:
        from syncd.procs import stop_process

        self.stop_daemon()
        if self.proxy is not None:
            stop_process(self.proxy, 30)  # open trajectories get written
        if self.node is not None:
            self.node.close()  # the workers drain and flush their replay records

    def __enter__(self) -> "RLStack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

