"""The ``syncd`` command line.

Commands (README.md has the full table of flags and their environment variables)::

    syncd --run-id RUN --engine URL ...  the node daemon (also ``syncd daemon``): keep engines current;
                                         with ``--cluster-rank R --cluster-peers ...`` one node of a cluster
    syncd status --run-id RUN            the node daemon's state (from its status file)
    syncd demo [--json PATH]             an RL run that learns, on this machine (--weights-only: weight sync only)
    syncd train --model DIR --proxy URL  the thin RL trainer (python -m syncd.trainer.run; syncd train --help)
    syncd ls [--run-id RUN]              runs in the store, or the versions of one run
    syncd verify --run-id RUN [--quick]  check every version of a run (exit 1 if any is unusable)
    syncd gc --run-id RUN [--dry-run]    apply the retention policy
    syncd materialize --run-id RUN --out DIR [--version V] [--config-from MODEL_DIR]
                                         a version as a Hugging Face folder (from_pretrained, SGLang, evals)
    syncd tasks qa [--out PATH]          the agent task family's verifier QA (syncd tasks --help)
    syncd keygen --out PREFIX            an Ed25519 key pair: PREFIX.key (the publisher's, mode 0600) and
                                         PREFIX.pub (for daemons, engines, readers); prints the key id

Every flag has a ``SYNCD_*`` environment variable; a flag given on the command line wins. Keys are read from
files (``--signing-key-file``: the publisher's private key, or a legacy HMAC secret; ``--verify-key``,
repeatable: the public keys a verifier accepts) or ``SYNCD_SIGNING_KEY``, never from a flag's value, so that
no secret shows up in process listings (:mod:`syncd.signing`). Exit status: 0 fine, 1 verification found a
problem, 2 usage or configuration error, 3 store unreachable or other runtime error. The daemon exits 0 after
SIGTERM/SIGINT. The commands that read and report (status, ls, verify, gc) are :mod:`syncd.app.commands`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from syncd.app.commands import check_writable, gc, ls, materialize, need_run, open_store, size, status, value, verify
from syncd.errors import SyncdError
from syncd.procs import port_taken

log = logging.getLogger("syncd.app.cli")

#: flag dest -> (environment variable, default)
ENV = {
    "store": ("SYNCD_STORE", None),
    "run_id": ("SYNCD_RUN_ID", None),
    "endpoint": ("SYNCD_STORE_ENDPOINT", None),
    "store_option": ("SYNCD_STORE_OPTIONS", ""),
    "signing_key_file": ("SYNCD_SIGNING_KEY_FILE", None),
    "verify_key": ("SYNCD_VERIFY_KEYS", ""),
    "log_level": ("SYNCD_LOG_LEVEL", None),  # None: INFO for the daemon, WARNING for the other commands
    "keep_last": ("SYNCD_KEEP_LAST", "8"),
    "grace": ("SYNCD_GC_GRACE_S", "300"),
    "orphan_grace": ("SYNCD_GC_ORPHAN_GRACE_S", "3600"),
    "log_format": ("SYNCD_LOG_FORMAT", "text"),
    # the node daemon
    "engine": ("SYNCD_ENGINES", ""),
    "cache_dir": ("SYNCD_CACHE_DIR", None),
    "cache_max_bytes": ("SYNCD_CACHE_MAX_BYTES", "16G"),
    "poll_interval_s": ("SYNCD_POLL_INTERVAL_S", "0.5"),
    "poll_jitter": ("SYNCD_POLL_JITTER", "0.2"),
    "backoff_max_s": ("SYNCD_BACKOFF_MAX_S", "10"),
    "engine_check_s": ("SYNCD_ENGINE_CHECK_S", "1"),
    "download_concurrency": ("SYNCD_DOWNLOAD_CONCURRENCY", "8"),
    "metrics_port": ("SYNCD_METRICS_PORT", ""),
    "metrics_addr": ("SYNCD_METRICS_ADDR", "127.0.0.1"),
    "status_file": ("SYNCD_STATUS_FILE", None),
    "allow_unsigned": ("SYNCD_ALLOW_UNSIGNED", ""),
    "engine_lease_s": ("SYNCD_ENGINE_LEASE_S", "10"),
    "engine_scrub_bytes": ("SYNCD_ENGINE_SCRUB_BYTES", "640M"),
    "engine_scrub_s": ("SYNCD_ENGINE_SCRUB_S", "10"),
    "engine_token_file": ("SYNCD_ENGINE_TOKEN_FILE", None),
}


def _common(p: argparse.ArgumentParser) -> None:
    s = argparse.SUPPRESS  # unset flags stay absent, so env/defaults can fill them after parsing
    p.add_argument("--store", default=s, metavar="URL",
                   help="store URL or path (file://, memory://, s3://, gs://, az://) [SYNCD_STORE]")
    p.add_argument("--run-id", default=s, metavar="RUN", help="run id [SYNCD_RUN_ID]")
    p.add_argument("--endpoint", default=s, metavar="URL",
                   help="where the cloud store is: an S3-compatible endpoint (overrides AWS_ENDPOINT_URL), a GCS "
                        "base URL or an Azure account URL, e.g. an emulator's [SYNCD_STORE_ENDPOINT]")
    p.add_argument("--store-option", default=s, action="append", metavar="KEY=VALUE",
                   help="extra obstore option, repeatable (e.g. region=eu-west-1) "
                        "[SYNCD_STORE_OPTIONS, comma-separated]")
    p.add_argument("--signing-key-file", default=s, metavar="PATH",
                   help="file holding a manifest key: the publisher's private key, one public key, or a legacy "
                        "HMAC secret [SYNCD_SIGNING_KEY_FILE; or SYNCD_SIGNING_KEY]")
    p.add_argument("--verify-key", default=s, action="append", metavar="FILE",
                   help="public key file (PREFIX.pub of `syncd keygen`) whose signatures are accepted, repeatable: "
                        "during a key rotation both keys [SYNCD_VERIFY_KEYS, comma-separated]")
    p.add_argument("--log-level", default=s, metavar="LEVEL", help="logging level [SYNCD_LOG_LEVEL]")
    p.add_argument("--log-format", default=s, choices=("text", "json"),
                   help="log lines as text or one JSON object each [SYNCD_LOG_FORMAT]")
    p.add_argument("--allow-unsigned", default=s, action="store_const", const="1",
                   help="without a signing key, read signed manifests without checking them (refused by "
                        "default) [SYNCD_ALLOW_UNSIGNED=1]")


def _daemon_flags(p: argparse.ArgumentParser) -> None:
    s = argparse.SUPPRESS
    p.add_argument("--engine", default=s, action="append", metavar="[NAME=]URL",
                   help="control URL of an engine process to keep current, repeatable "
                        "[SYNCD_ENGINES, comma-separated]")
    p.add_argument("--cache-dir", default=s, metavar="DIR",
                   help="node shard cache [SYNCD_CACHE_DIR; default $XDG_CACHE_HOME/syncd]")
    p.add_argument("--cache-max-bytes", default=s, metavar="N",
                   help="cache bound, e.g. 16G (what a restart needs is kept beyond it) [SYNCD_CACHE_MAX_BYTES]")
    p.add_argument("--poll-interval-s", default=s, type=float, metavar="S",
                   help="seconds between polls of the run's newest version [SYNCD_POLL_INTERVAL_S]")
    p.add_argument("--poll-jitter", default=s, type=float, metavar="F",
                   help="random spread of the poll interval, a fraction [SYNCD_POLL_JITTER]")
    p.add_argument("--backoff-max-s", default=s, type=float, metavar="S",
                   help="longest wait between polls while the store fails [SYNCD_BACKOFF_MAX_S]")
    p.add_argument("--engine-check-s", default=s, type=float, metavar="S",
                   help="seconds between checks of the engines' versions [SYNCD_ENGINE_CHECK_S]")
    p.add_argument("--download-concurrency", default=s, type=int, metavar="N",
                   help="shards downloaded at once [SYNCD_DOWNLOAD_CONCURRENCY]")
    p.add_argument("--metrics-port", default=s, metavar="PORT",
                   help="serve Prometheus metrics on this port (0: any free one; empty: off) [SYNCD_METRICS_PORT]")
    p.add_argument("--metrics-addr", default=s, metavar="ADDR", help="metrics bind address [SYNCD_METRICS_ADDR]")
    p.add_argument("--status-file", default=s, metavar="PATH",
                   help="the daemon's state file [SYNCD_STATUS_FILE; default <cache-dir>/status-<run>.json]")
    p.add_argument("--engine-lease-s", default=s, type=float, metavar="S",
                   help="seconds this daemon's lease on each engine lasts without renewal [SYNCD_ENGINE_LEASE_S]")
    p.add_argument("--engine-scrub-bytes", default=s, metavar="N",
                   help="engine weight bytes checksummed per scrub, e.g. 640M (0: off) [SYNCD_ENGINE_SCRUB_BYTES]")
    p.add_argument("--engine-scrub-s", default=s, type=float, metavar="S",
                   help="seconds between scrubs of each engine's weights [SYNCD_ENGINE_SCRUB_S]")
    p.add_argument("--engine-token-file", default=s, metavar="PATH",
                   help="the node's engine control token [SYNCD_ENGINE_TOKEN_FILE; default "
                        "~/.config/syncd/engine-token]")
    from syncd.daemon.cluster import add_cluster_flags

    add_cluster_flags(p)


_USAGE = "%(prog)s [COMMAND] [--run-id RUN] [--store URL] [options]   (syncd COMMAND --help: that command's)"
_DEFAULTS = {"log_level": "INFO for the daemon, WARNING for the other commands", "cache_dir": None,
             "status_file": None, "store": "file://$XDG_DATA_HOME/syncd/store", "metrics_port": "off",
             "store_option": None, "engine": None, "allow_unsigned": None, "verify_key": None}


def _show_defaults(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Write each flag's default into its help, ``[SYNCD_X]`` -> ``[SYNCD_X; default D]`` (the defaults live in
    :data:`ENV`, applied after parsing, so argparse cannot show them itself)."""
    for action in parser._actions:  # noqa: SLF001 -- argparse has no public way to reach its actions
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            for sub in action.choices.values():
                _show_defaults(sub)
            continue
        var, default = ENV.get(action.dest, (None, None))
        shown = _DEFAULTS.get(action.dest, default)
        if var and shown not in (None, "") and action.help and f"[{var}]" in action.help:
            action.help = action.help.replace(f"[{var}]", f"[{var}; default {shown}]")
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="syncd", usage=_USAGE,
        description="Weight versions in object storage, and the node daemon that keeps engines on the newest one "
                    "(run without a command: the daemon). Every flag also reads a SYNCD_* variable (named in "
                    "brackets); a flag given wins.")
    from syncd import __version__

    parser.add_argument("--version", action="version", version=f"syncd {__version__}",
                        help="print syncd's version and exit")
    _common(parser)
    _daemon_flags(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", prog="syncd")
    p = sub.add_parser("daemon", help="the node daemon (the same as giving no command)",
                       usage="syncd daemon --run-id RUN --engine [NAME=]URL ... [options]")
    _common(p)
    _daemon_flags(p)
    p = sub.add_parser("status", help="the node daemon's state")
    _common(p)
    p.add_argument("--cache-dir", default=argparse.SUPPRESS, metavar="DIR", help="[SYNCD_CACHE_DIR]")
    p.add_argument("--status-file", default=argparse.SUPPRESS, metavar="PATH", help="[SYNCD_STATUS_FILE]")
    p.add_argument("--json", action="store_true", help="print the status file as JSON")
    sub.add_parser("demo", add_help=False,
                   help="an RL run that learns on this machine: trainer, daemon, two engines under Dynamo, proxy "
                        "(--weights-only: the weight-sync demo; syncd demo --help)")
    sub.add_parser("train", add_help=False,
                   help="the thin RL trainer (python -m syncd.trainer.run; syncd train --help)")
    sub.add_parser("tasks", add_help=False, help="the agent task family and its verifier QA (syncd tasks --help)")
    sub.add_parser("rollouts", add_help=False,
                   help="the rollout service: prompt dispatch into the run's queue in the store, whether or not a "
                        "trainer runs (syncd rollouts --help)")
    sub.add_parser("serve", add_help=False,
                   help="start and supervise this node's Dynamo engine workers and frontend "
                        "(python -m syncd.engine.dynamo.serve; syncd serve --help)")
    p = sub.add_parser("ls", help="list runs, or the versions of --run-id")
    _common(p)
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p = sub.add_parser("verify", help="verify every version of a run")
    _common(p)
    p.add_argument("--quick", action="store_true",
                   help="check manifests and shard sizes only; do not download and rebuild the weights")
    p.add_argument("--version", type=int, default=None, help="verify only this version (and its chain)")
    p = sub.add_parser("gc", help="delete old versions by the retention policy")
    _common(p)
    p.add_argument("--keep-last", default=argparse.SUPPRESS, type=int, help="versions kept [SYNCD_KEEP_LAST]")
    p.add_argument("--grace", default=argparse.SUPPRESS, type=float,
                   help="seconds a superseded version stays for readers [SYNCD_GC_GRACE_S]")
    p.add_argument("--orphan-grace", default=argparse.SUPPRESS, type=float,
                   help="seconds before unreferenced objects are removed [SYNCD_GC_ORPHAN_GRACE_S]")
    p.add_argument("--dry-run", action="store_true", help="show what would be deleted")
    p = sub.add_parser("materialize", help="write a version as a Hugging Face model folder (from_pretrained reads it)")
    _common(p)
    p.add_argument("--version", type=int, default=None, help="the version (default: the newest)")
    p.add_argument("--out", required=True, metavar="DIR", help="the folder to write (must not exist or be empty)")
    p.add_argument("--config-from", default=None, metavar="MODEL_DIR",
                   help="take config.json and the tokenizer from this model folder (default: the files the "
                        "publisher stored with the run)")
    p.add_argument("--max-shard-size", default="5G", metavar="N",
                   help="largest safetensors file; more weights than that are split into model-0000N-of-0000M "
                        "files with an index (default: %(default)s)")
    p = sub.add_parser("keygen", help="make an Ed25519 key pair for signing manifests",
                       usage="syncd keygen --out PREFIX",
                       description="Write PREFIX.key (the private key: only the publisher gets it, mode 0600) and "
                                   "PREFIX.pub (the public key: daemons, engines and readers get it, --verify-key) "
                                   "and print the key id. Existing files are never overwritten.")
    p.add_argument("--out", required=True, metavar="PREFIX", help="path prefix of the two files")
    return _show_defaults(parser)


def _resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill every flag not given from its ``SYNCD_*`` variable (or default); ``args.source_of[dest]`` names
    where each value came from, so that an error names the variable an operator actually set."""
    args.source_of = {}
    for dest, (var, default) in ENV.items():
        flag = "--" + dest.replace("_", "-")
        if hasattr(args, dest):
            args.source_of[dest] = flag
            continue
        args.source_of[dest] = var if var in os.environ else flag
        value = os.environ.get(var, default)
        if dest in ("store_option", "verify_key"):
            value = [v for v in (value or "").split(",") if v.strip()]
        setattr(args, dest, value)
    return args


def _daemon_config(args):
    from syncd.daemon import DaemonConfig, EngineSpec

    engines = args.engine if isinstance(args.engine, list) else [e for e in args.engine.split(",") if e.strip()]
    if not engines:
        raise ValueError("--engine (or SYNCD_ENGINES) is required: the engines this daemon keeps current")
    specs = tuple(value(args, "engine", lambda _, e=e, i=i: EngineSpec.parse(e, i),
                        f"[NAME=]http://HOST:PORT (in {e!r})") for i, e in enumerate(engines))
    port = str(args.metrics_port).strip()
    metrics_port = value(args, "metrics_port", int, "a port number") if port else None
    taken = metrics_port and port_taken(args.metrics_addr, metrics_port)
    if taken:
        raise ValueError(f"{args.source_of['metrics_port']}={metrics_port}: the metrics server cannot listen on "
                         f"{args.metrics_addr}:{metrics_port} ({taken}); pick another port, 0 for a free one")
    if args.cache_dir:
        check_writable(args.cache_dir, args.source_of["cache_dir"], folder=True)
    what = "a size (e.g. 16G, 500M, 1073741824)"
    return DaemonConfig(
        run_id=need_run(args), store_url=args.store,
        engines=specs,
        cache_dir=Path(args.cache_dir) if args.cache_dir else None,
        cache_max_bytes=value(args, "cache_max_bytes", size, what),
        poll_interval_s=value(args, "poll_interval_s", float), poll_jitter=value(args, "poll_jitter", float),
        backoff_max_s=value(args, "backoff_max_s", float), engine_check_s=value(args, "engine_check_s", float),
        download_concurrency=value(args, "download_concurrency", int, "an integer"),
        metrics_port=metrics_port,
        metrics_addr=args.metrics_addr, status_file=Path(args.status_file) if args.status_file else None,
        engine_lease_s=value(args, "engine_lease_s", float),
        engine_scrub_bytes=value(args, "engine_scrub_bytes", size, what),
        engine_scrub_s=value(args, "engine_scrub_s", float),
        engine_token_file=Path(args.engine_token_file) if args.engine_token_file else None)


def _run_daemon(args, out) -> int:
    from syncd.daemon import NodeDaemon, run
    from syncd.daemon.cluster import ClusterLink, cluster_settings

    from syncd.versions import refuse_unchecked

    config = _daemon_config(args)
    cluster = cluster_settings(args)
    store, key = open_store(args)
    refuse_unchecked(store, config.run_id, key)
    daemon = NodeDaemon(config, store=store, signing_key=key, poll=cluster is None)
    if cluster is not None:  # the cluster's controller polls; versions arrive through the cluster node
        daemon.attach(ClusterLink(daemon, cluster, store=store))
        c = cluster.config
        log.info("syncd daemon: cluster node rank %d, members %s", c.rank,
                    ",".join(f"{r}={m.host}:{m.port}" for r, m in sorted(c.peers.items())) if c.peers
                    else f"from the store directory {c.cluster_id!r}")
    log.info("syncd daemon: run %s, store %s, engines %s, cache %s, status %s", config.run_id, store.url,
             ", ".join(f"{e.name}={e.url}" for e in config.engines), daemon.cache.root, daemon.status.path)
    run(daemon)
    return 0


def _keygen(args, out) -> int:
    """``syncd keygen --out PREFIX``: the key id on the first line, then where each file went."""
    from syncd.signing.keyfiles import write_keypair

    private, public, key = write_keypair(args.out)
    out.write(f"{key.key_id}\n"
              f"private key {private} (mode 0600): the publisher's only (SYNCD_SIGNING_KEY_FILE / --signing-key-file)\n"
              f"public key  {public}: for daemons, engines and readers (SYNCD_VERIFY_KEYS / --verify-key)\n")
    return 0


class _JsonFormatter(logging.Formatter):
    """One JSON object per log line: ts (unix seconds), level, logger, msg, and exc when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        doc = {"ts": round(record.created, 6), "level": record.levelname, "logger": record.name,
               "msg": record.getMessage(), "pid": record.process}
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc)


def _setup_logging(level: int, fmt: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(_JsonFormatter() if fmt == "json" else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler])


_PROGRAMS = ("serve", "demo", "train", "tasks")  # commands that are programs of their own, with their own flags


def _program_first(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """``argv`` with a program command (:data:`_PROGRAMS`) moved to the front when only ``syncd`` flags come
    before it (``syncd --log-level INFO train ...`` is ``syncd train --log-level INFO ...``): the first token that
    is neither a flag nor a flag's value is the command."""
    i = 0
    while i < len(argv) and argv[i] != "--":
        tok = argv[i]
        if not tok.startswith("-"):
            return [tok, *argv[:i], *argv[i + 1:]] if tok in _PROGRAMS and i else argv
        action = parser._option_string_actions.get(tok)
        i += 2 if action is not None and action.nargs != 0 else 1
    return argv


def main(argv=None) -> int:
    """Entry point of the ``syncd`` console script; returns the exit status."""
    parser = build_parser()
    argv = _program_first(list(sys.argv[1:] if argv is None else argv), parser)
    if argv[:1] == ["serve"]:  # its own flags (syncd.engine.dynamo.serve); arguments after `--` go to every worker
        from syncd.engine.dynamo.serve import main as serve_main

        return serve_main(argv[1:])
    if argv[:1] == ["demo"]:  # its own flags (syncd.app.rl_demo; --weights-only: syncd.app.demo's)
        from syncd.app.rl_demo import main as demo_main

        return demo_main(argv[1:])
    if argv[:1] == ["train"]:  # its own flags (syncd.trainer.run)
        from syncd.trainer.run import main as train_main

        return train_main(argv[1:])
    if argv[:1] == ["rollouts"]:  # its own flags (syncd.trainer.rl.rollout_service)
        from syncd.trainer.rl.rollout_service import main as rollouts_main

        return rollouts_main(argv[1:])
    if argv[:1] == ["tasks"]:  # its own flags (syncd.app.tasks_cli)
        from syncd.app.tasks_cli import main as tasks_main

        return tasks_main(argv[1:])
    args = _resolve(parser.parse_args(argv))
    commands = {"ls": ls, "verify": verify, "gc": gc, "status": status, "daemon": _run_daemon,
                "materialize": materialize, "keygen": _keygen}
    if args.command is None and args.run_id:
        args.command = "daemon"
    if args.command not in commands:
        parser.print_help(sys.stderr)
        return 2
    level = logging.getLevelName(str(args.log_level or ("INFO" if args.command == "daemon" else "WARNING")).upper())
    bad = (f"{args.source_of['log_level']}={args.log_level!r} is not a logging level (DEBUG, INFO, WARNING, "
           "ERROR)" if not isinstance(level, int) else
           f"{args.source_of['log_format']}={args.log_format!r} is not text or json"
           if args.log_format not in ("text", "json") else None)
    if bad:
        print(f"syncd {args.command}: {bad}", file=sys.stderr)
        return 2
    _setup_logging(level, args.log_format)
    try:
        return commands[args.command](args, sys.stdout)
    except BrokenPipeError:  # `syncd ls | head`: the reader left; what it did not read is not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's flush at exit must not raise again
        return 0
    except SyncdError as exc:
        print(f"syncd {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 3
    except ValueError as exc:  # configuration: bad URL, option, key, run id
        print(f"syncd {args.command}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # e.g. the metrics port is taken, the cache directory is not writable
        print(f"syncd {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 3


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
