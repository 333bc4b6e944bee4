"""The ``syncd`` commands that read and report: ``status`` (the node daemon's state file), ``ls``, ``verify`` and
``gc`` of a run in the store, and the helpers they share with the daemon's settings (a flag's value with the
flag or variable it came from in its error, the store, the signing policy). Each command takes the resolved
arguments (:func:`syncd.app.cli.build_parser`) and an output stream, and returns the exit status."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from syncd import manifest as mf
from syncd.errors import SyncdError

__all__ = ["value", "size", "check_writable", "signing", "open_store", "need_run", "status", "cluster_lines", "ls",
           "verify", "gc", "materialize", "unknown_run"]


def value(args, dest: str, conv, what: str = "a number"):
    """``conv(args.<dest>)``; a bad value raises ``ValueError`` naming the flag or the variable it came from."""
    raw = getattr(args, dest)
    try:
        return conv(raw)
    except (TypeError, ValueError):
        where = getattr(args, "source_of", {}).get(dest, "--" + dest.replace("_", "-"))
        raise ValueError(f"{where}={raw!r} is not {what}") from None


def check_writable(path, flag: str, *, folder: bool = False) -> Path:
    """``path`` (a file a flag names, written later; with ``folder``, a folder files are written into) resolved;
    ``ValueError`` naming ``flag`` and ``path`` at once when it cannot be written: a file that is a folder, or a
    folder that cannot be made or written to (the work must not be done for nothing, nor end in a hidden temp
    path's error). Makes the folders on the way."""
    import tempfile

    out = Path(path).expanduser().resolve()
    where = out if folder else out.parent
    try:
        if not folder and out.is_dir():
            raise IsADirectoryError(21, "is a folder")
        where.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=where, prefix=f".{out.name}.", suffix=".check"):
            pass
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot be written ({exc.strerror or exc})") from None
    return out


def size(text) -> int:
    """``16G``, ``500M``, ``64k``, ``1073741824`` -> bytes (binary multiples); ``ValueError`` otherwise."""
    t = str(text).strip().upper().removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(t[-1:], 1)
    return int(float(t[:-1] if mult > 1 else t) * mult)


def signing(args):
    """The readers' signing policy from the flags: a key (or a keyring: ``--verify-key`` public keys),
    ``UNCHECKED`` (no key, ``--allow-unsigned``) or ``False`` (no key: signed manifests are refused)."""
    from syncd.signing import ENV_ALLOW_UNSIGNED, ENV_VERIFY_KEYS, UNCHECKED, env_flag, key_from_env

    env = dict(os.environ)
    if args.signing_key_file:
        env.pop("SYNCD_SIGNING_KEY", None)
        env["SYNCD_SIGNING_KEY_FILE"] = args.signing_key_file
    env[ENV_VERIFY_KEYS] = ",".join(args.verify_key)
    key = key_from_env(env)
    allow = value(args, "allow_unsigned", lambda v: env_flag(ENV_ALLOW_UNSIGNED, {ENV_ALLOW_UNSIGNED: v or ""}),
                   "a boolean (1 or 0)")
    if key is not None:
        return key
    return UNCHECKED if allow else False


def open_store(args):
    """The store (never created: every command here only reads it) and the signing policy."""
    from syncd.store import Store

    options = {}
    for item in args.store_option:
        k, sep, v = item.partition("=")
        if not sep or not k.strip():
            raise ValueError(f"{args.source_of.get('store_option', '--store-option')}: {item!r} is not KEY=VALUE")
        options[k.strip()] = v.strip()
    store = Store(args.store, endpoint=args.endpoint, options=options, create=False)
    return store, signing(args)


def status(args, out) -> int:
    from syncd.cache import default_cache_dir
    from syncd.daemon.status import default_status_file, pid_alive, read_status

    if args.status_file:
        path = Path(args.status_file)
    else:
        cache = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
        path = default_status_file(cache, need_run(args))
    try:
        doc = read_status(path)
    except (OSError, ValueError) as exc:
        out.write(f"no daemon status at {path}: {exc}\n")
        return 3
    alive = doc.get("state") not in ("stopped",) and pid_alive(int(doc.get("pid", 0)))
    if args.json:
        out.write(json.dumps({**doc, "alive": alive}, indent=1) + "\n")
    else:
        age = time.time() - float(doc.get("updated_at") or 0)
        out.write(f"run {doc.get('run_id')}  store {doc.get('store')}\n")
        out.write(f"daemon pid {doc.get('pid')}: {doc.get('state') if alive else 'not running'} "
                  f"(status written {age:.1f}s ago)  newest version {doc.get('newest_version')}\n")
        for what in ("run_error", "store_error", "cache_error", "round_error"):
            if doc.get(what):
                out.write(f"{what.replace('_', ' ')}: {doc[what]}\n")
        for name, t in sorted((doc.get("tasks") or {}).items()):
            if t.get("restarts"):
                out.write(f"task {name}: {t.get('state')}, restarted {t['restarts']} times, last: "
                          f"{t.get('last_error')}\n")
        if doc.get("metrics_url"):
            out.write(f"metrics: {doc['metrics_url']}\n")
        out.write(f"{'ENGINE':12} {'VERSION':>8} {'LAG':>4} {'LAST PAUSE':>10}  {'STATE':14} URL\n")
        for name, e in sorted(doc.get("engines", {}).items()):
            pause = "-" if e.get("last_pause_s") is None else f"{e['last_pause_s'] * 1e3:.1f}ms"
            out.write(f"{name:12} {_or_dash(e.get('version')):>8} {_or_dash(e.get('lag')):>4} {pause:>10}  "
                      f"{_or_dash(e.get('state')):14} {e.get('url')}\n")
            if e.get("error"):
                out.write(f"{'':12} error: {e['error']}\n")
        if doc.get("cluster"):
            out.write(cluster_lines(doc["cluster"]))
        totals = doc.get("totals") or {}
        if totals:
            out.write("totals:\n" + "".join(f"  {k.replace('_', ' '):32} {_amount(k, v)}\n"
                                             for k, v in sorted(totals.items())))
    engines = doc.get("engines", {}).values()
    healthy = alive and not doc.get("run_error") and all(e.get("state") == "serving" and e.get("lag") == 0
                                                         for e in engines)
    return 0 if healthy else 1


def _or_dash(v) -> str:
    return "-" if v is None else str(v)


def _amount(name: str, v) -> str:
    """A status total for people: bytes in binary units, counts as integers."""
    if "bytes" in name.split(":")[0]:
        n = float(v)
        for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
            if abs(n) < 1024 or unit == "TiB":
                return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
            n /= 1024
    return f"{v:,.0f}" if float(v).is_integer() else f"{v:,.3f}"


def cluster_lines(c: dict) -> str:
    """``syncd status``: the cluster node's part (see :meth:`syncd.cluster.ClusterNode.summary`)."""
    ctrl = c.get("controller")
    role = ("controller" if c.get("is_controller") else "no controller yet" if ctrl is None
            else f"controller rank {ctrl}")

    def mib(n) -> str:
        return f"{(n or 0) / (1 << 20):.2f} MiB"

    return (f"cluster: rank {c.get('rank')} at {c.get('listen')}, {role} (term {c.get('term')}), "
            f"live {c.get('live')} of {c.get('members')}, delivered version {c.get('delivered')}\n"
            f"cluster: received {mib(c.get('received_bytes'))} in {c.get('received_chunks')} chunks from peers, "
            f"{mib(c.get('store_bytes'))} from the store; served {mib(c.get('served_bytes'))} in "
            f"{c.get('served_chunks')} chunks; relays lost {c.get('relays_lost')}, refused connections "
            f"{c.get('refused_connections')}, bad frames {c.get('bad_frames')}, peer restarts "
            f"{c.get('peer_restarts')}\n")


def need_run(args) -> str:
    if not args.run_id:
        raise ValueError("--run-id (or SYNCD_RUN_ID) is required")
    return value(args, "run_id", mf.check_run_id, "a run id (1-128 of [A-Za-z0-9._-], starting with a letter or "
                                                  "digit)")


def _needs_a_key(infos) -> list:
    """The versions of ``infos`` (:class:`syncd.versions.VersionInfo`) refused only because they are signed and the
    reader has no key."""
    from syncd.signing import NO_KEY_HELP

    return [i for i in infos if i.manifest is None and i.error and NO_KEY_HELP in i.error]


def _no_key_summary(run: str, refused: list) -> str:
    """One line for every version of ``run`` refused for lack of a key (instead of one refusal per version)."""
    import re

    ids = sorted({k for i in refused for k in re.findall(r"key id '([0-9a-f]+)'", i.error)})
    return (f"run {run}: versions {_ranges(i.version for i in refused)} are signed (key id {', '.join(ids) or '?'}) "
            "and no key is configured to verify them: give the publisher's public key (--verify-key PREFIX.pub, "
            "or SYNCD_VERIFY_KEYS), or --allow-unsigned to read them unchecked\n")


def ls(args, out) -> int:
    from syncd.versions import list_versions

    store, key = open_store(args)
    if not args.run_id:
        for run in store.list_dirs("runs/"):
            out.write((json.dumps({"run_id": run}) if args.json else run) + "\n")
        return 0
    infos = list_versions(store, need_run(args), signing_key=key)
    if not infos:
        return unknown_run(store, args.run_id)
    refused = _needs_a_key(infos)
    if refused:  # one summary, not one refusal per version; the versions that could be read are listed
        infos = [i for i in infos if i not in refused]
        sys.stderr.write(f"syncd ls: {_no_key_summary(args.run_id, refused)}")
        if not infos:
            return 2
    if not args.json:
        out.write(f"{'VERSION':>8} {'KIND':5} {'BASE':>6} {'STEP':>8} {'CREATED (UTC)':26} {'SHARDS':>6} "
                  f"{'BYTES':>12} STATUS\n")
    for i in infos:
        m = i.manifest
        row = {"version": i.version, "status": i.status, "error": i.error}
        if m is not None:
            row.update(kind=m.kind, base_version=m.base_version, step=m.step, created_at=m.created_at,
                       shards=len(m.shards), bytes=m.total_bytes, tensors=len(m.tensors),
                       signed_by=m.signed_by, signature=m.signature_alg)
        if args.json:
            out.write(json.dumps(row) + "\n")
        elif m is not None:
            base = "-" if m.base_version is None else str(m.base_version)
            status = "ok" + (f" ({m.signature_text})" if m.signed_by else "")
            out.write(f"{i.version:>8} {m.kind:5} {base:>6} {m.step:>8} {m.created_at:26} {len(m.shards):>6} "
                      f"{m.total_bytes:>12} {status}\n")
        else:
            out.write(f"{i.version:>8} {'-':5} {'-':>6} {'-':>8} {'-':26} {'-':>6} {'-':>12} "
                      f"{i.status}{': ' + i.error if i.error else ''}\n")
    return 2 if refused else 0


def verify(args, out) -> int:
    from syncd.versions import materialize, verify_run

    store, key = open_store(args)
    run = need_run(args)
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
        return unknown_run(store, run)
    return 1 if failed else 0


def unknown_run(store, run: str) -> int:
    """``ls``/``verify``/``gc`` of a run without versions: say so, list the runs there are, exit 1."""
    others = [r for r in store.list_dirs("runs/") if r != run]
    print(f"syncd: run {run!r} has no versions in {store.url}; runs there: {', '.join(others) or 'none'}",
          file=sys.stderr)
    return 1


def gc(args, out) -> int:
    from syncd.retention import RetentionPolicy, apply_retention

    store, key = open_store(args)
    policy = RetentionPolicy(value(args, "keep_last", int, "an integer"), value(args, "grace", float),
                             value(args, "orphan_grace", float))
    run = need_run(args)
    if not store.list_dirs(mf.versions_prefix(run)):
        return unknown_run(store, run)
    from syncd.versions import list_versions

    refused = _needs_a_key(list_versions(store, run, signing_key=key))
    if refused:  # retention cannot tell what a version is built from without reading it: nothing is deleted
        sys.stderr.write(f"syncd gc: nothing deleted; {_no_key_summary(run, refused)}")
        return 2
    plan = apply_retention(store, run, policy, signing_key=key, dry_run=args.dry_run)
    verb = "would delete" if args.dry_run else "deleted"
    why = {"newest": f"the newest {policy.keep_last} (--keep-last)",
           "base": "the full version and deltas a kept version is built from",
           "grace": f"superseded less than {policy.grace_s:g} s ago, a reader may still use them (--grace)"}
    out.write(f"keep versions {_ranges(plan.keep) or 'none'}\n")
    for reason, text in why.items():
        kept = [v for v in plan.keep if plan.keep_reasons.get(v) == reason]
        if kept:
            out.write(f"  {_ranges(kept)}: {text}\n")
    out.write(f"{verb} versions {_ranges(plan.delete_versions) or 'none'} ({len(plan.delete_keys)} objects)\n")
    for p in plan.problems:
        out.write(f"problem: {p}\n")
    return 0


def materialize(args, out) -> int:
    """``syncd materialize``: one version of a run as a Hugging Face folder (:mod:`syncd.model_folder`)."""
    from syncd.model_folder import materialize_folder

    folder = Path(args.out)  # checked before the work, which may take long
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise ValueError(f"--out {folder}: exists and is not an empty directory (nothing was written)")
    if not folder.exists():
        check_writable(folder, "--out")
    shard = value(args, "max_shard_size", size, "a size (e.g. 5G, 500M)")
    store, key = open_store(args)
    run = need_run(args)
    if not store.list_dirs(mf.versions_prefix(run)):
        return unknown_run(store, run)
    done = materialize_folder(store, run, args.version, args.out, config_from=args.config_from, signing_key=key,
                              max_shard_bytes=shard)
    out.write(f"run {run} version {done['version']}: {done['tensors']} tensors, {done['bytes'] / 1e6:.1f} MB in "
              f"{', '.join(done['weight_files'])}; model files {', '.join(done['model_files'])}\n"
              f"wrote {done['out']} (transformers: AutoModelForCausalLM.from_pretrained({str(done['out'])!r}))\n")
    return 0


def _ranges(versions) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2, 5, 7-8"``."""
    out, run = [], []
    for v in sorted(versions):
        if run and v != run[-1] + 1:
            out.append(run)
            run = []
        run.append(v)
    if run:
        out.append(run)
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in out)
