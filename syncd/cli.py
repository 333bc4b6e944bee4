"""The ``syncd`` command line.

Subcommands (README.md has the full table of flags and their environment variables)::

    syncd ls [--run-id RUN]              runs in the store, or the versions of one run
    syncd verify --run-id RUN [--quick]  check every version of a run (exit 1 if any is unusable)
    syncd gc --run-id RUN [--dry-run]    apply the retention policy

Every flag has a ``SYNCD_*`` environment variable; a flag given on the command line wins. The signing key
is read only from ``SYNCD_SIGNING_KEY`` or a file (``--signing-key-file``), never from a flag, so that it
does not show up in process listings. Exit status: 0 fine, 1 verification found a problem, 2 usage or
configuration error, 3 store unreachable or other runtime error.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from syncd import manifest as mf
from syncd.errors import SyncdError

log = logging.getLogger("syncd.cli")

#: flag dest -> (environment variable, default)
ENV = {
    "store": ("SYNCD_STORE", None),
    "run_id": ("SYNCD_RUN_ID", None),
    "endpoint": ("SYNCD_STORE_ENDPOINT", None),
    "store_option": ("SYNCD_STORE_OPTIONS", ""),
    "signing_key_file": ("SYNCD_SIGNING_KEY_FILE", None),
    "log_level": ("SYNCD_LOG_LEVEL", "WARNING"),
    "keep_last": ("SYNCD_KEEP_LAST", "8"),
    "grace": ("SYNCD_GC_GRACE_S", "300"),
    "orphan_grace": ("SYNCD_GC_ORPHAN_GRACE_S", "3600"),
}


def _common(p: argparse.ArgumentParser) -> None:
    s = argparse.SUPPRESS  # unset flags stay absent, so env/defaults can fill them after parsing
    p.add_argument("--store", default=s, metavar="URL",
                   help="store URL or path (file://, memory://, s3://, gs://, az://) [SYNCD_STORE]")
    p.add_argument("--run-id", default=s, metavar="RUN", help="run id [SYNCD_RUN_ID]")
    p.add_argument("--endpoint", default=s, metavar="URL",
                   help="S3-compatible endpoint, overrides AWS_ENDPOINT_URL [SYNCD_STORE_ENDPOINT]")
    p.add_argument("--store-option", default=s, action="append", metavar="KEY=VALUE",
                   help="extra obstore option, repeatable (e.g. region=eu-west-1) "
                        "[SYNCD_STORE_OPTIONS, comma-separated]")
    p.add_argument("--signing-key-file", default=s, metavar="PATH",
                   help="file holding the manifest signing key [SYNCD_SIGNING_KEY_FILE; or SYNCD_SIGNING_KEY]")
    p.add_argument("--log-level", default=s, metavar="LEVEL", help="logging level [SYNCD_LOG_LEVEL]")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="syncd", description="Weight versions in object storage.")
    _common(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
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
    return parser


def _resolve(args: argparse.Namespace) -> argparse.Namespace:
    for dest, (var, default) in ENV.items():
        if not hasattr(args, dest):
            value = os.environ.get(var, default)
            if dest == "store_option":
                value = [v for v in (value or "").split(",") if v.strip()]
            setattr(args, dest, value)
    return args


def _open(args):
    from syncd.signing import key_from_env
    from syncd.store import Store

    options = {}
    for item in args.store_option:
        k, sep, v = item.partition("=")
        if not sep or not k.strip():
            raise ValueError(f"--store-option {item!r} is not KEY=VALUE")
        options[k.strip()] = v.strip()
    env = dict(os.environ)
    if args.signing_key_file:
        env.pop("SYNCD_SIGNING_KEY", None)
        env["SYNCD_SIGNING_KEY_FILE"] = args.signing_key_file
    key = key_from_env(env)
    store = Store(args.store, endpoint=args.endpoint, options=options, create=False)
    return store, (key if key is not None else False)


def _need_run(args) -> str:
    if not args.run_id:
        raise ValueError("--run-id (or SYNCD_RUN_ID) is required")
    return mf.check_run_id(args.run_id)


def _ls(args, out) -> int:
    from syncd.versions import list_versions

    store, key = _open(args)
    if not args.run_id:
        for run in store.list_dirs("runs/"):
            out.write((json.dumps({"run_id": run}) if args.json else run) + "\n")
        return 0
    infos = list_versions(store, _need_run(args), signing_key=key)
    if not args.json:
        out.write(f"{'VERSION':>8} {'KIND':5} {'BASE':>6} {'STEP':>8} {'CREATED (UTC)':26} {'SHARDS':>6} "
                  f"{'BYTES':>12} STATUS\n")
    for i in infos:
        m = i.manifest
        row = {"version": i.version, "status": i.status, "error": i.error}
        if m is not None:
            row.update(kind=m.kind, base_version=m.base_version, step=m.step, created_at=m.created_at,
                       shards=len(m.shards), bytes=m.total_bytes, tensors=len(m.tensors),
                       signed_by=m.signed_by)
        if args.json:
            out.write(json.dumps(row) + "\n")
        elif m is not None:
            base = "-" if m.base_version is None else str(m.base_version)
            status = "ok" + (" (signed)" if m.signed_by else "")
            out.write(f"{i.version:>8} {m.kind:5} {base:>6} {m.step:>8} {m.created_at:26} {len(m.shards):>6} "
                      f"{m.total_bytes:>12} {status}\n")
        else:
            out.write(f"{i.version:>8} {'-':5} {'-':>6} {'-':>8} {'-':26} {'-':>6} {'-':>12} "
                      f"{i.status}{': ' + i.error if i.error else ''}\n")
    return 0


def _verify(args, out) -> int:
    from syncd.versions import materialize, verify_run

    store, key = _open(args)
    run = _need_run(args)
    if args.version is not None:
        try:
            materialize(store, run, args.version, signing_key=key)
        except SyncdError as exc:
            out.write(f"{args.version:>8} FAILED {type(exc).__name__}: {exc}\n")
            return 1
        out.write(f"{args.version:>8} ok\n")
        return 0
    failed = seen = 0
    for version, status, message in verify_run(store, run, signing_key=key, deep=not args.quick):
        seen += status != "torn"
        failed += status == "failed"
        out.write(f"{version:>8} {status.upper() if status == 'failed' else status:6} {message}\n")
    out.write(f"{seen} versions checked, {failed} failed\n")
    if seen == 0:
        out.write(f"run {run!r} has no versions in {store.url}\n")
        return 1
    return 1 if failed else 0


def _gc(args, out) -> int:
    from syncd.versions import RetentionPolicy, apply_retention

    store, key = _open(args)
    policy = RetentionPolicy(int(args.keep_last), float(args.grace), float(args.orphan_grace))
    plan = apply_retention(store, _need_run(args), policy, signing_key=key, dry_run=args.dry_run)
    verb = "would delete" if args.dry_run else "deleted"
    out.write(f"keep versions {plan.keep}\n{verb} versions {plan.delete_versions} "
              f"({len(plan.delete_keys)} objects)\n")
    for p in plan.problems:
        out.write(f"problem: {p}\n")
    return 0


def main(argv=None) -> int:
    """Entry point of the ``syncd`` console script; returns the exit status."""
    parser = build_parser()
    args = _resolve(parser.parse_args(argv))
    level = logging.getLevelName(str(args.log_level).upper())
    if not isinstance(level, int):
        parser.error(f"unknown log level {args.log_level!r}")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    commands = {"ls": _ls, "verify": _verify, "gc": _gc}
    if args.command not in commands:
        parser.print_help(sys.stderr)
        return 2
    try:
        return commands[args.command](args, sys.stdout)
    except SyncdError as exc:
        print(f"syncd {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 3
    except ValueError as exc:  # configuration: bad URL, option, key, run id
        print(f"syncd {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
