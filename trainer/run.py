"""``python -m syncd.trainer.run`` (also ``syncd train`` and ``syncd-train``): the thin trainer's asynchronous RL run.

    python -m syncd.trainer.run --model DIR --store URL --run-id RUN --proxy URL [--proxy URL ...] --out DIR
                          [--task repeat] [--steps 30] [--group-size 8] [--groups-per-step 4] [--every-k 1]
                          [--max-lag 2] [--optimizer adamw|muon] [--nproc 2] [--daemon-status FILE] [--sync]
    python -m syncd.trainer.run --model DIR --store URL --run-id RUN --plans OLD/plans.jsonl --out DIR   # offline

It trains against engines that something else runs: ``syncd serve`` (the Dynamo frontend and workers, started
with ``--weights-version 0 --replay-store URL --run-id RUN`` on the same model folder), the node daemon
(``syncd --run-id RUN --engine ...``) and a sandbox proxy per ``--proxy`` (``syncd-proxy --upstream FRONTEND
--run-id RUN``). ``--nproc N`` runs N data-parallel ranks (it starts N-1 more processes of itself; under
``torchrun``, whose ``RANK``/``WORLD_SIZE`` are set, it runs one rank). ``--store`` and ``--run-id`` default to
``SYNCD_STORE`` and ``SYNCD_RUN_ID``; the signing key comes from ``SYNCD_SIGNING_KEY``.

Rank 0 prints the summary as one JSON object on stdout (also ``OUT/summary.json``). Exit status: 0 done; 1 the
run failed (no rollouts, a rank died, the store failed); 2 bad configuration (the message names the flag).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from syncd.cli_help import HelpFormatter
from syncd.procs import free_port

__all__ = ["main", "parser", "config_from_args"]

log = logging.getLogger("syncd.trainer.run")


def _band(text: str) -> tuple[float, float]:
    try:
        lo, hi = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW,HIGH (e.g. 0.5,2.0), got {text!r}") from None
    return lo, hi


def parser() -> argparse.ArgumentParser:
    from syncd.trainer.rl.rollout_service import rollout_flags

    env = os.environ.get
    p = argparse.ArgumentParser(prog="syncd train", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    a = p.add_argument
    a("--model", required=True, help="the model folder the engines serve as version 0 (config.json, weights)")
    a("--store", default=env("SYNCD_STORE"), help="store URL for versions and records [SYNCD_STORE]")
    a("--run-id", default=env("SYNCD_RUN_ID"), help="run id of versions, replay and trajectory records [SYNCD_RUN_ID]")
    a("--proxy", action="append", default=[], metavar="URL",
      help="sandbox proxy in front of the frontend (repeat): the trainer starts the rollout service in its process")
    a("--external-rollouts", action="store_true",
      help="the groups come from `syncd rollouts` processes through the run's queue; the trainer starts none")
    a("--out", required=True, help="folder for metrics.jsonl, plans.jsonl, summary.json, run.png")
    rollout_flags(p, workers_help="groups generated at once (default: groups-per-step)")
    a("--steps", type=int, default=30, help="optimizer steps")
    a("--groups-per-step", type=int, default=4, help="prompts (groups) per step")
    a("--every-k", type=int, default=1, help="K: publish a version every K steps")
    a("--max-lag", type=int, default=2, help="eta: drop groups with a token more than eta versions behind")
    a("--lookahead", type=int, default=None,
      help="groups requested ahead of training (default: 2 x groups-per-step; 1 x with eta 0)")
    a("--optimizer", default="adamw", help="adamw, or muon (Muon for hidden matrices, AdamW for the rest)")
    a("--lr", type=float, default=1e-2)
    a("--weight-decay", type=float, default=0.0)
    a("--grad-clip", type=float, default=1.0, help="global gradient-norm clip (0: off)")
    a("--is-cap", type=float, default=2.0, help="token-level truncated IS cap C (0: untruncated)")
    a("--is-band", type=_band, default=None, metavar="LOW,HIGH", help="mask tokens whose IS ratio is outside")
    a("--is-seq-band", type=_band, default=None, metavar="LOW,HIGH", help="reject sequences by geometric-mean ratio")
    a("--curate", type=_band, default=None, metavar="LOW,HIGH",
      help="difficulty filter: keep task items whose solve rate is inside LOW,HIGH (syncd.trainer.rl.curation)")
    a("--curate-pool", type=int, default=64, help="task items the filter estimates (with --curate)")
    a("--curate-confidence", type=float, default=0.9,
      help="posterior mass outside the band that drops an item (with --curate)")
    a("--micro-batch", type=int, default=64, help="sequences per forward/backward")
    a("--no-adv-scale", action="store_true", help="advantages r - mean, not divided by the group's std")
    a("--seed", type=int, default=0)
    a("--threads", type=int, default=1, help="torch intra-op threads per rank (fixed: determinism)")
    a("--full-every", type=int, default=16, help="a full version every that many (deltas between)")
    a("--delta-format", default=env("SYNCD_DELTA_FORMAT", "1"), metavar="1|2",
      help="codec format of the deltas: 2 is about 0.75x the bytes, but engines must hold each tensor whole to "
           "decode it (see --sliced-tensors) [SYNCD_DELTA_FORMAT]")
    a("--sliced-tensors", default=env("SYNCD_SLICED_TENSORS"), metavar="REGEX",
      help="with --delta-format 2: trainer tensors some engine holds only in slices (tensor parallel), written "
           "in format 1 (full match) [SYNCD_SLICED_TENSORS]")
    a("--daemon-status", default=None, metavar="FILE", help="the node daemon's status file: engine versions")
    a("--sync", action="store_true", help="synchronous baseline: generate, then train, then update")
    a("--plans", default=None, metavar="FILE", help="train offline on the plans.jsonl of an earlier run")
    a("--save-weights", action="store_true", help="write OUT/weights.safetensors (float32) at the end")
    a("--no-plot", action="store_true", help="no OUT/run.png")
    a("--nproc", type=int, default=1, help="data-parallel ranks (processes)")
    a("--rollout-timeout", type=float, default=300.0, help="seconds a step may wait for rollouts")
    ft = p.add_argument_group("fault tolerance (docs/trainer.md)")
    b = ft.add_argument
    b("--checkpoint-dir", default=None, metavar="DIR",
      help="node-local folder for per-step checkpoints (each rank's) and the replicas it holds for its peers")
    b("--resume", action="store_true", help="continue the run from the newest step every rank can restore "
      "(its checkpoints in --checkpoint-dir, else the replicas its peers hold)")
    b("--standby", action="store_true", help="with --resume: start warm (imports, model, optimizer, ranks "
      "connected) and hold until rank 0's process receives SIGUSR1, then take the run over (docs/trainer.md)")
    b("--replicas", type=int, default=1, help="k: peers on other nodes that hold a copy of each rank's checkpoint")
    b("--keep-checkpoints", type=int, default=2, help="checkpoints kept per rank (and replicas per peer)")
    b("--checkpoint-busy", choices=("wait", "skip"), default="wait",
      help="a step due while the previous checkpoint is still being written: wait for the write (every step "
           "checkpointed; a stall only while a write takes longer than a step) or skip its checkpoint (no stall; a "
           "crash may then cost more than one step; the ranks skip the same steps)")
    b("--node", default=None, help="this process's node id for replica placement [SYNCD_NODE, else the host name;"
      " '{rank}' in it is replaced by the rank]")
    b("--ft-host", default="127.0.0.1", help="address the replica server (and torchft's manager) binds and advertises")
    b("--lighthouse", default=env("TORCHFT_LIGHTHOUSE"), metavar="URL",
      help="elastic job: torchft lighthouse URL; this process is one replica group [TORCHFT_LIGHTHOUSE]")
    b("--replica-groups", type=int, default=1, help="elastic job: how many replica groups it has")
    b("--replica-group", type=int, default=0, help="elastic job: this process's group (a fresh job's group 0 runs "
      "the live side first; another takes it over when its leader is gone)")
    b("--min-replicas", type=int, default=1, help="elastic job: fewer participants never commit a step")
    b("--ft-timeout", type=float, default=30.0, help="elastic job: seconds before a silent peer counts as dead")
    b("--leader-timeout", type=float, default=10.0, help="elastic job: seconds without the leading group's "
      "heartbeat before a waiting group takes the live side over")
    a("--log-level", default=env("SYNCD_LOG_LEVEL", "WARNING"))
    return p


def _curation(args):
    if args.curate is None:
        return None
    from syncd.trainer.rl.curation import CurationConfig
    from syncd.trainer.rl.config import ConfigError

    try:
        return CurationConfig(band=args.curate, pool=args.curate_pool, confidence=args.curate_confidence)
    except ValueError as exc:
        raise ConfigError(f"--curate/--curate-pool/--curate-confidence: {exc}") from None


def _delta_format(text: str) -> int:
    from syncd.trainer.rl.config import ConfigError

    if text.strip() not in ("1", "2"):
        raise ConfigError(f"--delta-format (or SYNCD_DELTA_FORMAT): must be 1 or 2, got {text!r}")
    return int(text)


def config_from_args(args):
    """The :class:`~syncd.trainer.rl.config.LoopConfig` of parsed flags. Raises ConfigError naming a bad flag."""
    from syncd.trainer.rl.config import LoopConfig

    return LoopConfig(
        model=args.model, store=args.store, run_id=args.run_id, out=args.out, proxies=tuple(args.proxy),
        external_rollouts=args.external_rollouts,
        task=args.task, task_length=args.task_length, reward=args.reward, steps=args.steps, group_size=args.group_size,
        groups_per_step=args.groups_per_step, every_k=args.every_k, max_lag=args.max_lag, lookahead=args.lookahead,
        workers=args.workers, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        optimizer=args.optimizer, lr=args.lr, weight_decay=args.weight_decay, grad_clip=args.grad_clip,
        is_cap=args.is_cap or None, is_band=args.is_band, is_seq_band=args.is_seq_band, micro_batch=args.micro_batch,
        adv_scale=not args.no_adv_scale, seed=args.seed, threads=args.threads, full_every=args.full_every,
        delta_format=_delta_format(args.delta_format), sliced_tensors=args.sliced_tensors or None,
        daemon_status=args.daemon_status, sync=args.sync, plans=args.plans, save_weights=args.save_weights,
        plot=not args.no_plot, rollout_timeout_s=args.rollout_timeout, curation=_curation(args),
        checkpoint_dir=args.checkpoint_dir, resume=args.resume, standby=args.standby, replicas=args.replicas,
        keep_checkpoints=args.keep_checkpoints, checkpoint_busy=args.checkpoint_busy, node=args.node,
        ft_host=args.ft_host, lighthouse=args.lighthouse, replica_group=args.replica_group,
        replica_groups=args.replica_groups, min_replicas=args.min_replicas, ft_timeout_s=args.ft_timeout,
        leader_timeout_s=args.leader_timeout)


def _check_writable(folder, flag: str) -> None:
    """ConfigError naming ``flag`` unless ``folder`` can be created and written now (not after the run)."""
    from syncd.trainer.rl.config import ConfigError

    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-check-"):
            pass
    except OSError as exc:
        raise ConfigError(f"{flag}: cannot write to {folder}: {exc.strerror or exc}") from None


def _preflight(cfg) -> None:
    """What rank 0 checks before any rank starts (ConfigError naming the flag)."""
    from syncd.errors import StoreError
    from syncd.trainer.rl.config import ConfigError

    cfg.check()
    _check_writable(cfg.out, "--out")
    if cfg.plans:
        return
    from syncd.trainer.rl.rollout_workers import ProxyError, proxy_models

    for url in cfg.proxies:
        try:
            proxy_models(url)
        except ProxyError as exc:
            raise ConfigError(f"--proxy: no engines reachable through {url}: {exc}") from None
    from syncd.versions import has_versions

    try:
        taken = not cfg.resume and cfg.lighthouse is None and has_versions(cfg.store, cfg.run_id)
    except StoreError as exc:
        raise ConfigError(f"--store (or SYNCD_STORE): cannot list run {cfg.run_id} in {cfg.store}: {exc}") from None
    if taken:
        raise ConfigError(f"--run-id: run {cfg.run_id} already has versions in {cfg.store}; the engines start "
                          "from version 0: use a new run id (or --resume with its --checkpoint-dir)")



def _launch(argv: list[str], nproc: int) -> int:
    """Rank 0 here, ranks 1..N-1 as processes of this module; a rank that fails stops the others."""
    port = str(free_port())
    base = dict(os.environ, WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    children = [subprocess.Popen([sys.executable, "-m", "syncd.trainer.run", *argv],
                                 env={**base, "RANK": str(r), "LOCAL_RANK": str(r)}, start_new_session=True)
                for r in range(1, nproc)]
    os.environ.update(WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", LOCAL_RANK="0")
    done = threading.Event()

    def watch():
        while not done.wait(0.5):
            for r, c in enumerate(children, 1):
                if c.poll() not in (None, 0):
                    print(f"syncd.trainer.run: rank {r} exited with {_exit_status(c.returncode)}; stopping the run",
                          file=sys.stderr, flush=True)
                    for other in children:
                        if other.poll() is None:
                            other.kill()
                    os._exit(1)

    threading.Thread(target=watch, name="rank-watch", daemon=True).start()
    try:
        rc = _run_rank(argv)
    finally:
        done.set()
        for c in children:
            try:
                c.wait(60)
            except subprocess.TimeoutExpired:
                c.send_signal(signal.SIGKILL)
                c.wait()
    failed = [(r, c.returncode) for r, c in enumerate(children, 1) if c.returncode]
    for r, status in failed:  # seen after rank 0 returned (a rank that died earlier stopped the run above)
        print(f"syncd.trainer.run: rank {r} exited with {_exit_status(status)}", file=sys.stderr, flush=True)
    return rc or (1 if failed else 0)


def _exit_status(returncode: int) -> str:
    """``"status N"`` or ``"signal SIGKILL"`` for a child's ``returncode``."""
    if returncode >= 0:
        return f"status {returncode}"
    try:
        return f"signal {signal.Signals(-returncode).name}"
    except ValueError:
        return f"signal {-returncode}"


def _run_rank(argv: list[str]) -> int:
    from syncd.errors import SyncdError
    from syncd.trainer.rl.config import ConfigError
    from syncd.trainer.jobs import run_job

    args = parser().parse_args(argv)
    try:
        summary = run_job(config_from_args(args))
    except ConfigError as exc:
        print(f"syncd.trainer.run: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, SyncdError, OSError, TimeoutError) as exc:
        print(f"syncd.trainer.run: rank {os.environ.get('RANK', '0')}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if os.environ.get("RANK", "0") == "0" or args.lighthouse:
        print(json.dumps(summary), flush=True)
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if args.standby:  # before the slow imports: SIGUSR1's default action would end the process
        from syncd.trainer import standby

        standby.arm()
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("torchao", "torch.utils._pytree"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    if logging.getLogger().level > logging.INFO:  # torchft logs every quorum (Rust, at info) and warns on each
        os.environ.setdefault("RUST_LOG", "warn")  # reconfiguration that it cannot reset NCCL's flight recorder
        logging.getLogger("torchft").setLevel(logging.ERROR)
    from syncd.trainer.rl.config import ConfigError

    if args.nproc < 1:
        print("syncd.trainer.run: --nproc: must be >= 1", file=sys.stderr)
        return 2
    if args.nproc > 1 and args.lighthouse:
        print("syncd.trainer.run: --nproc: an elastic job (--lighthouse) runs one process per replica group; start "
              "each with its --replica-group", file=sys.stderr)
        return 2
    if ("RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1) or args.lighthouse:
        if args.lighthouse:  # a replica group: no collective preflight; its own errors exit 2
            try:
                config_from_args(args).check()
            except ConfigError as exc:
                print(f"syncd.trainer.run: {exc}", file=sys.stderr)
                return 2
        return _run_rank(argv)  # one rank of torchrun or of --nproc, or one replica group
    try:
        _preflight(config_from_args(args))
    except ConfigError as exc:
        print(f"syncd.trainer.run: {exc}", file=sys.stderr)
        return 2
    if args.nproc > 1:
        return _launch(argv, args.nproc)
    t = time.time()
    rc = _run_rank(argv)
    log.info("done in %.1f s", time.time() - t)
    return rc


if __name__ == "__main__":
    sys.exit(main())
