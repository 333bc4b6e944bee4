"""``python -m engine.proxy``: run one sandbox's proxy until SIGTERM/SIGINT (then every open trajectory is
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

__all__ = ["main", "parser"]


def parser() -> argparse.ArgumentParser:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="python -m engine.proxy", description=__doc__.split("\n\n")[0])
    p.add_argument("--upstream", default=env("SYNCD_PROXY_UPSTREAM"), help="Dynamo frontend URL (SYNCD_PROXY_UPSTREAM)")
    p.add_argument("--store", default=env("SYNCD_STORE"), help="store URL for records (SYNCD_STORE; default: the embedded one)")
    p.add_argument("--run-id", default=env("SYNCD_RUN_ID"), help="run id (SYNCD_RUN_ID)")
    p.add_argument("--sandbox-id", default=env("SYNCD_SANDBOX_ID"), help="this sandbox's id (SYNCD_SANDBOX_ID)")
    p.add_argument("--trajectory-id", default=None, help="trajectory of requests without an X-Syncd-Trajectory header")
    p.add_argument("--per-request", action="store_true", help="every request is a trajectory of its own")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=int(env("SYNCD_PROXY_PORT", "0")), help="0: a free port")
    p.add_argument("--retry-attempts", type=int, default=5, help="tries of a request that fails before any token")
    p.add_argument("--retry-deadline", type=float, default=60.0, help="seconds those tries may take in all")
    p.add_argument("--spill-dir", default=env("SYNCD_PROXY_SPILL_DIR"),
                   help="where records go that the store refused until the proxy stopped")
    p.add_argument("--close-timeout", type=float, default=30.0,
                   help="seconds a stopping proxy retries records the store refused before it reports them")
    p.add_argument("--compact-model", default=env("SYNCD_PROXY_COMPACT_MODEL"),
                   help="self-compaction on: the model folder (its tokenizer, its max_position_embeddings as the "
                        "window) (SYNCD_PROXY_COMPACT_MODEL)")
    p.add_argument("--compact-window", type=int, default=None, help="context window in tokens (default: the model's)")
    p.add_argument("--compact-trigger", type=float, default=0.75,
                   help="compact when prompt + max_tokens would pass this share of the window")
    p.add_argument("--compact-summary-tokens", type=int, default=64, help="max_tokens of the summary request")
    p.add_argument("--compact-summary-prompt", default=None, help="text appended to ask for the summary")
    p.add_argument("--compact-keep-prompt", type=int, default=64,
                   help="tokens of the original prompt kept at the head of a continuation")
    p.add_argument("--ready-file", default=None, help="write {url, pid} here once serving")
    p.add_argument("--log-level", default=env("SYNCD_LOG_LEVEL", "WARNING"))
    return p


def main(argv=None) -> int:
    """0: clean stop; 2: bad arguments."""
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from engine.proxy.record import RecordError
    from engine.proxy.server import Proxy, ProxyConfig

    missing = [f for f, v in (("--upstream", args.upstream), ("--run-id", args.run_id),
                              ("--sandbox-id", args.sandbox_id)) if not v]
    if missing:
        print(f"engine.proxy: {', '.join(missing)} required", file=sys.stderr)
        return 2
    try:
        compaction = None
        if args.compact_model:
            from engine.proxy.compaction import CompactionConfig

            kw = {k: v for k, v in (("window", args.compact_window), ("summary_prompt", args.compact_summary_prompt))
                  if v is not None}
            compaction = CompactionConfig.for_model(args.compact_model, trigger=args.compact_trigger,
                                                    summary_tokens=args.compact_summary_tokens,
                                                    keep_prompt=args.compact_keep_prompt, **kw)
        config = ProxyConfig(upstream=args.upstream, run_id=args.run_id, sandbox_id=args.sandbox_id,
                             default_trajectory=args.trajectory_id, per_request=args.per_request,
                             retry_attempts=args.retry_attempts, retry_deadline_s=args.retry_deadline,
                             spill_dir=Path(args.spill_dir) if args.spill_dir else None, compaction=compaction)
        proxy = Proxy(config, args.store)
    except (RecordError, ValueError, OSError, KeyError) as exc:
        print(f"engine.proxy: {exc}", file=sys.stderr)
        return 2

    async def run():
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        url = await proxy.start(args.host, args.port)
        if args.ready_file:
            tmp = Path(args.ready_file + ".tmp")
            tmp.write_text(json.dumps({"url": url, "pid": os.getpid()}))
            os.replace(tmp, args.ready_file)
        await stop.wait()
        await proxy.close(args.close_timeout)

    import uvloop

    uvloop.run(run())
    return 0
