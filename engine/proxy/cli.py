"""``python -m syncd.engine.proxy``: run one sandbox's proxy until SIGTERM/SIGINT (then every open trajectory is
written). Flags override the ``SYNCD_*`` variables named in ``--help``."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path

from syncd.urls import check_http_url

__all__ = ["main", "parser"]


def parser() -> argparse.ArgumentParser:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="python -m syncd.engine.proxy", description=__doc__.split("\n\n")[0])
    p.add_argument("--upstream", default=None,
                   help="Dynamo frontend URL, e.g. http://127.0.0.1:8000 (SYNCD_PROXY_UPSTREAM)")
    p.add_argument("--store", default=env("SYNCD_STORE"), help="store URL for records (SYNCD_STORE; default: the embedded one)")
    p.add_argument("--run-id", default=env("SYNCD_RUN_ID"), help="run id (SYNCD_RUN_ID)")
    p.add_argument("--sandbox-id", default=env("SYNCD_SANDBOX_ID"), help="this sandbox's id (SYNCD_SANDBOX_ID)")
    p.add_argument("--trajectory-id", default=None, help="trajectory of requests without an X-Syncd-Trajectory header")
    p.add_argument("--per-request", action="store_true", help="every request is a trajectory of its own")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=None, help="0: a free port (SYNCD_PROXY_PORT; default 0)")
    p.add_argument("--retry-attempts", type=int, default=5, help="tries of a request that fails before any token")
    p.add_argument("--retry-deadline", type=float, default=60.0, help="seconds those tries may take in all")
    p.add_argument("--spill-dir", default=env("SYNCD_PROXY_SPILL_DIR"),
                   help="where records go that the store refused until the proxy stopped")
    p.add_argument("--close-timeout", type=float, default=30.0,
                   help="seconds a stopping proxy retries records the store refused before it reports them")
    p.add_argument("--compact-model", default=env("SYNCD_PROXY_COMPACT_MODEL"),
                   help="self-compaction on: the model folder (its tokenizer, its chat template for chat requests, "
                        "its max_position_embeddings as the window) (SYNCD_PROXY_COMPACT_MODEL)")
    p.add_argument("--compact-window", type=int, default=None, help="context window in tokens (default: the model's)")
    p.add_argument("--compact-trigger", type=float, default=0.75,
                   help="compact when prompt + max_tokens would pass this share of the window")
    p.add_argument("--compact-summary-tokens", type=int, default=64, help="max_tokens of the summary request")
    p.add_argument("--compact-summary-prompt", default=None, help="text appended to ask for the summary")
    p.add_argument("--compact-resume-prompt", default=None, help="text put before the summary in a continuation")
    p.add_argument("--compact-continue-prompt", default=None, help="text put after the summary in a continuation")
    p.add_argument("--compact-max", type=int, default=64, help="compactions one request may take at most")
    p.add_argument("--compact-keep-prompt", type=int, default=64,
                   help="tokens of the original prompt kept at the head of a continuation")
    p.add_argument("--ready-file", default=None, help="write {url, pid} here once serving")
    p.add_argument("--log-level", default=None, help="logging level (SYNCD_LOG_LEVEL; default WARNING)")
    return p


def _from_env(given, flag: str, var: str, default: str, convert, what: str):
    """``given`` (the flag's value) or the variable ``var`` (else ``default``), converted; a ValueError names
    the flag or the variable the bad value came from."""
    if given is not None:
        source, text = flag, given
    else:
        source, text = (var, os.environ[var]) if var in os.environ else (flag, default)
    try:
        return convert(text)
    except ValueError:
        raise ValueError(f"{source}={text!r} is not {what}") from None


def _port(text) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise ValueError(port)
    return port


def _level(text) -> int:
    level = logging.getLevelName(str(text).upper())
    if not isinstance(level, int):
        raise ValueError(text)
    return level


def main(argv=None) -> int:
    """0: clean stop; 2: bad arguments or settings; 3: it could not serve (the port is taken, say)."""
    args = parser().parse_args(argv)
    try:
        level = _from_env(args.log_level, "--log-level", "SYNCD_LOG_LEVEL", "WARNING", _level,
                          "a logging level (DEBUG, INFO, WARNING, ERROR)")
        port = _from_env(args.port, "--port", "SYNCD_PROXY_PORT", "0", _port, "a port number (0-65535)")
    except ValueError as exc:
        print(f"syncd.engine.proxy: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from syncd.engine.proxy.record import RecordError
    from syncd.engine.proxy.server import Proxy, ProxyConfig

    upstream = args.upstream if args.upstream is not None else os.environ.get("SYNCD_PROXY_UPSTREAM")
    missing = [f for f, v in (("--upstream", upstream), ("--run-id", args.run_id),
                              ("--sandbox-id", args.sandbox_id)) if not v]
    if missing:
        print(f"syncd.engine.proxy: {', '.join(missing)} required", file=sys.stderr)
        return 2
    try:
        check_http_url(upstream, "--upstream" if args.upstream is not None else "SYNCD_PROXY_UPSTREAM")
        compaction = None
        if args.compact_model:
            from syncd.engine.proxy.compaction import CompactionConfig

            kw = {k: v for k, v in (("window", args.compact_window), ("summary_prompt", args.compact_summary_prompt),
                                    ("resume_prompt", args.compact_resume_prompt),
                                    ("continue_prompt", args.compact_continue_prompt)) if v is not None}
            compaction = CompactionConfig.for_model(args.compact_model, trigger=args.compact_trigger,
                                                    summary_tokens=args.compact_summary_tokens,
                                                    keep_prompt=args.compact_keep_prompt,
                                                    max_compactions=args.compact_max, **kw)
        config = ProxyConfig(upstream=upstream, run_id=args.run_id, sandbox_id=args.sandbox_id,
                             default_trajectory=args.trajectory_id, per_request=args.per_request,
                             retry_attempts=args.retry_attempts, retry_deadline_s=args.retry_deadline,
                             spill_dir=Path(args.spill_dir) if args.spill_dir else None, compaction=compaction)
        proxy = Proxy(config, args.store)
    except (RecordError, ValueError, OSError, KeyError) as exc:
        print(f"syncd.engine.proxy: {exc}", file=sys.stderr)
        return 2

    async def run():
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            url = await proxy.start(args.host, port)
        except OSError as exc:
            print(f"syncd.engine.proxy: cannot serve on {args.host}:{port}: {exc}", file=sys.stderr)
            await proxy.close(0)
            return 3
        if args.ready_file:
            tmp = Path(args.ready_file + ".tmp")
            tmp.write_text(json.dumps({"url": url, "pid": os.getpid()}))
            os.replace(tmp, args.ready_file)
        await stop.wait()
        await proxy.close(args.close_timeout)
        return 0

    import uvloop

    return uvloop.run(run())
