"""The standalone cluster node process, ``python -m syncd.cluster.node`` (a node without engines, for tests and
benchmarks): flags, ``SYNCD_CLUSTER_*`` variables, and :func:`main`. The node daemon reuses
:func:`build_parser` and :func:`config_from_args` for its ``--cluster-*`` flags."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from dataclasses import fields

from syncd.cluster import membership
from syncd.cluster.auth import ClusterSecret
from syncd.cluster.config import ENV_PREFIX, ClusterConfig
from syncd.store import Store


def _env(name: str, default=None):
    return os.environ.get(ENV_PREFIX + name.upper().replace("-", "_"), default)


def _hostport(text: str) -> tuple[str, int]:
    host, port = text.rsplit(":", 1)
    return host.strip("[]"), int(port)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m syncd.cluster.node",
                                description="Run one syncd cluster node without engines. Every flag can also "
                                            "be set as SYNCD_CLUSTER_<FLAG> (e.g. SYNCD_CLUSTER_RANK); a flag "
                                            "on the command line wins.")
    a = p.add_argument
    a("--store", default=_env("store", os.environ.get("SYNCD_STORE")), help="store URL or path")
    a("--endpoint", default=_env("endpoint", os.environ.get("SYNCD_STORE_ENDPOINT")), help="S3 endpoint")
    a("--store-option", action="append", default=None, help="K=V obstore option (repeatable)")
    a("--run-id", default=_env("run_id", os.environ.get("SYNCD_RUN_ID")))
    a("--rank", type=int, default=_env("rank"))
    a("--peers", default=_env("peers"), help="static members: RANK=HOST:PORT,...")
    a("--peers-from-store", dest="cluster_id", default=_env("peers_from_store"),
      help="find members in the store directory clusters/<ID>/members/")
    a("--advertise", default=_env("advertise"),
      help="HOST:PORT other nodes reach this one at (store directory or etcd)")
    a("--listen", default=_env("listen"), help="HOST:PORT to bind (default: this node's address)")
    a("--etcd", default=_env("etcd", os.environ.get("SYNCD_ETCD")),
      help="etcd client URL(s), comma-separated (or SYNCD_ETCD): membership as a lease per node and the controller "
           "elected through etcd, with fencing by term (default: the embedded election)")
    a("--cache-root", default=_env("cache_root"), help="local cache directory")
    a("--cluster-secret-file", default=_env("secret_file"),
      help="file holding the cluster secret (or set SYNCD_CLUSTER_SECRET)")
    a("--signing-key-file", default=os.environ.get("SYNCD_SIGNING_KEY_FILE"),
      help="manifest key file: a public key, or a legacy HMAC secret (or SYNCD_SIGNING_KEY; more public keys: "
           "SYNCD_VERIFY_KEYS)")
    for name, typ in (("heartbeat-s", float), ("dead-after-s", float), ("poll-s", float), ("discover-s", float),
                      ("fanout", int), ("chunk-bytes", int), ("store-streams", int), ("pull-window", int),
                      ("stall-s", float), ("store-fallback-s", float), ("pace-timeout-s", float),
                      ("slow-fraction", float), ("throttle-bps", float), ("etcd-ttl-s", int)):
        a("--" + name, type=typ, default=_env(name))
    a("--no-fsync", action="store_true", default=_env("no_fsync") in ("1", "true", "yes"))
    a("--verify-first", action="store_true", default=_env("verify_first") in ("1", "true", "yes"),
      help="roots check a whole shard against the manifest before forwarding any of it")
    a("--events", default=_env("events"), help="append JSON-lines events here")
    a("--log-level", default=_env("log_level", os.environ.get("SYNCD_LOG_LEVEL", "WARNING")))
    return p


def config_from_args(args) -> ClusterConfig:
    if args.rank is None:
        raise ValueError("--rank (or SYNCD_CLUSTER_RANK) is required")
    kw = {}
    for f in fields(ClusterConfig):
        v = getattr(args, f.name, None)
        if v is not None and f.name not in ("rank", "peers", "cluster_id", "advertise", "listen", "fsync",
                                            "verify_first"):
            kw[f.name] = v
    return ClusterConfig(rank=int(args.rank), peers=membership.parse_peers(args.peers) if args.peers else None,
                         cluster_id=args.cluster_id, advertise=_hostport(args.advertise) if args.advertise else None,
                         listen=_hostport(args.listen) if args.listen else None, fsync=not args.no_fsync,
                         verify_first=args.verify_first, **kw)


async def _amain(args) -> int:
    cfg = config_from_args(args)
    secret = ClusterSecret.from_file(args.cluster_secret_file) if args.cluster_secret_file else ClusterSecret.from_env()
    if secret is None:
        raise ValueError("no cluster secret: set SYNCD_CLUSTER_SECRET or --cluster-secret-file")
    key = None
    if args.signing_key_file:
        from syncd.signing import ENV_VERIFY_KEYS, key_from_env

        key = key_from_env({"SYNCD_SIGNING_KEY_FILE": args.signing_key_file,
                            ENV_VERIFY_KEYS: os.environ.get(ENV_VERIFY_KEYS, "")})
    options = dict(o.split("=", 1) for o in (args.store_option or []))
    store = Store(args.store, endpoint=args.endpoint, options=options or None)
    if not args.run_id or not args.cache_root:
        raise ValueError("--run-id and --cache-root are required")
    from syncd.cluster.node import ClusterNode

    node = ClusterNode(store, args.run_id, secret=secret, cache_root=args.cache_root, config=cfg,
                       signing_key=key, events=args.events)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await node.start()
    try:
        await stop.wait()
    finally:
        await node.stop()
    return 0


def main(argv=None) -> int:
    """Run one node until SIGTERM/SIGINT. Returns 0, or 2 for bad settings."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=str(args.log_level).upper(),
                        format=f"%(asctime)s node{args.rank} %(name)s %(levelname)s %(message)s")
    try:
        try:
            import uvloop
        except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
            return asyncio.run(_amain(args))
        return uvloop.run(_amain(args))
    except ValueError as exc:
        print(f"syncd.cluster.node: {exc}", file=sys.stderr)
        return 2

