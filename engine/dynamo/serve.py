"""Start and supervise the Dynamo pieces of one inference node: engine workers and, where wanted, the frontend.

    syncd serve --model DIR [--workers N] [--frontend --http-port P] [--migration-limit M]
                [--discovery file|etcd [--start-services]] [--ready-file F] [--unmanaged] [-- WORKER ARGS]

(``python -m syncd.engine.dynamo.serve`` runs the same :func:`main`.) Each worker is a process
``python -m syncd.engine.dynamo.worker`` with its own system port (admin routes ``/engine/weights/<op>`` for the
node daemon: pass the URLs in the ready file to ``syncd --engine``); arguments after ``--`` go to every worker
(e.g. ``--engine MODULE:FACTORY``, ``--weights-version 0 --replay-store URL --run-id RUN``). Discovery:
``file`` (default, no servers) or ``etcd`` + NATS given by ``--etcd-endpoints``/``--nats-server``, or started
locally with ``--start-services``. A node's file discovery is its own: ``<run dir>/discovery`` unless
``--file-kv``/``SYNCD_DYNAMO_FILE_KV`` names a folder to share, so a second node on the same host never joins the
first one's pool.

Weights: a worker started without ``--weights-version`` holds weights of no version and registers with the
frontend only once the node daemon has loaded the newest verified version into it. ``--weights-version V``
(after ``--``) serves the folder's weights as version V at once: for a node that starts with its run (the trainer
publishes that folder as version 0). A worker that exits and is restarted always comes back without it, so the
frontend routes to it only once the daemon has brought it to the newest version (a restart never serves stale
weights); ``--unmanaged`` (a node no daemon drives) restarts it with the folder's weights as first started.

Supervision: a worker or frontend that exits while the node runs has what is left of its process group killed
(each child runs in a session of its own: vLLM's engine-core and worker processes outlive a SIGKILLed worker)
and is restarted after a backoff (1 s doubling to 30 s); one that fails ``--restart-limit`` times within ten
minutes stops the node (exit status 1). On SIGTERM/SIGINT the workers get SIGTERM first (they leave discovery
at once and drain), then the frontend, then local services; anything still running after the grace period is
killed. A taken ``--http-port`` or ``--system-port-base`` port is refused at once (exit status 2, naming it).

The ready file (JSON, written atomically once every worker is visible through discovery and the frontend
lists the model, rewritten after each restart) holds ``frontend`` (URL or null), ``model``, ``workers``
(``name``, ``pid``, ``admin_url``, ``instance_id``, ``restarts``), the discovery settings and the pid of the
supervisor.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from syncd.cli_help import HelpFormatter
from syncd.engine.dynamo.node import Node, NodeConfig
from syncd.engine.dynamo.settings import add_arguments, add_frontend_arguments, env_int, from_args

log = logging.getLogger(__name__)

__all__ = ["main", "parser"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="syncd serve", description=__doc__.split("\n\n")[0],
                                usage="%(prog)s --model DIR [--workers N] [--frontend] [options] [-- WORKER ARGS]",
                                formatter_class=HelpFormatter,
                                epilog="Arguments after -- go to every worker (python -m syncd.engine.dynamo.worker "
                                       "--help), e.g. -- --weights-version 0 --replay-store URL --run-id RUN.")
    p.add_argument("--model", required=True, help="model folder (config.json, tokenizer, weights)")
    p.add_argument("--served-model-name", default=None, help="OpenAI model name (default: the folder's name)")
    p.add_argument("--workers", type=env_int("SYNCD_DYNAMO_WORKERS"),
                   default=os.environ.get("SYNCD_DYNAMO_WORKERS", "1"), help="engine workers [SYNCD_DYNAMO_WORKERS]")
    p.add_argument("--engine", default=None,
                   help="the workers' engine: reference, vllm or MODULE:FACTORY (passed to every worker; default: "
                        "the worker's, SYNCD_DYNAMO_ENGINE or reference)")
    p.add_argument("--frontend", action="store_true", help="also run the OpenAI HTTP frontend")
    add_frontend_arguments(p)
    p.add_argument("--system-port-base", type=int, default=0,
                   help="worker i's admin port is BASE + i (0: free ports, see the ready file)")
    p.add_argument("--start-services", action="store_true", help="start etcd + NATS locally (etcd discovery)")
    p.add_argument("--run-dir", default=None,
                   help="logs, ready files and the node's file discovery (default: /tmp/syncd-node-<pid>)")
    p.add_argument("--ready-file", default=None, help="copy the node description (JSON) here once up")
    p.add_argument("--unmanaged", action="store_true",
                   help="no node daemon drives these workers: a restarted worker serves the folder's weights (its "
                        "--weights-version) at once again. Default: it registers only once the daemon has loaded "
                        "the newest version")
    p.add_argument("--restart-limit", type=int, default=5,
                   help="failures of one worker or the frontend within ten minutes before the node stops")
    p.add_argument("--startup-timeout", type=float, default=180.0, help="seconds the node may take to come up")
    p.add_argument("--log-level", default=os.environ.get("SYNCD_LOG_LEVEL", "INFO"), help="[SYNCD_LOG_LEVEL]")
    add_arguments(p, file_kv_default="<run dir>/discovery: this node's own")
    return p


def main(argv=None) -> int:
    """Run a node until SIGTERM/SIGINT. 0: clean stop; 1: a child failed for good or the node did not come
    up; 2: bad arguments."""
    argv = list(sys.argv[1:] if argv is None else argv)
    worker_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, worker_args = argv[:i], argv[i + 1:]
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.start_services:
        args.discovery = "file"  # replaced by the etcd + NATS the node starts
    try:
        settings = from_args(args)
        run_dir = Path(args.run_dir) if args.run_dir else Path("/tmp", f"syncd-node-{os.getpid()}")
        config = NodeConfig(model=Path(args.model), run_dir=run_dir, workers=args.workers, frontend=args.frontend,
                            http_host=args.http_host, http_port=args.http_port,
                            migration_limit=args.migration_limit, settings=settings,
                            served_model_name=args.served_model_name, system_port_base=args.system_port_base,
                            worker_args=tuple((["--engine", args.engine] if args.engine else []) + worker_args),
                            start_services=args.start_services, managed=not args.unmanaged,
                            restart_limit=args.restart_limit, startup_timeout_s=args.startup_timeout,
                            ready_file=Path(args.ready_file) if args.ready_file else None)
        node = Node(config)
        if not Path(args.model, "config.json").is_file():
            raise ValueError(f"--model {args.model} has no config.json (need a model folder)")
        node.check_ports()
    except ValueError as exc:
        print(f"syncd serve: {exc}", file=sys.stderr)
        return 2
    if args.unmanaged:
        log.warning("--unmanaged: no node daemon keeps these workers current; a restarted worker serves the "
                    "folder's weights again")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        node.start()
    except ValueError as exc:  # a port taken since the check above
        print(f"syncd serve: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"syncd serve: the node did not come up: {exc}", file=sys.stderr)
        return 1
    log.info("node up: %s", json.dumps(node.describe()))
    node.supervise(background=True)
    while not stop.wait(0.5):
        if node.closing:
            break
    node.close()
    if node.failed:
        print(f"syncd serve: {node.failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
