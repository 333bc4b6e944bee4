"""The Dynamo OpenAI frontend, started from ``ai-dynamo-runtime`` alone.

``python -m syncd.engine.dynamo.frontend --http-port P [--migration-limit N] ...`` runs the same Rust HTTP
frontend as ``python -m dynamo.frontend`` (``dynamo.llm.make_engine`` + ``run_input``: model discovery,
tokenization and chat templates, routing, request migration), without the ``ai-dynamo`` package and its
heavier dependencies. It serves ``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses``, ``/v1/models``
(and ``/v1/models/<id>``), ``/health`` for every model the workers of ``--namespace`` register.

``--migration-limit N`` (default 3): when a worker dies mid-stream, the frontend re-sends the prompt plus
the tokens generated so far to another worker, up to N times per request (0 disables migration).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from syncd.engine.dynamo.settings import add_arguments, add_frontend_arguments, from_args

log = logging.getLogger(__name__)

__all__ = ["main", "parser", "ROUTER_MODES"]

ROUTER_MODES = ("round-robin", "random", "least-loaded")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m syncd.engine.dynamo.frontend", description=__doc__.split("\n\n")[0])
    add_frontend_arguments(p)
    p.add_argument("--router-mode", choices=ROUTER_MODES, default="round-robin")
    p.add_argument("--log-level", default=os.environ.get("SYNCD_LOG_LEVEL", "WARNING"))
    add_arguments(p)
    return p


def main(argv=None) -> int:
    """Serve until SIGTERM/SIGINT. Exit status 0 on a clean stop, 2 on bad arguments."""
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.migration_limit < 0:
        print("syncd.engine.dynamo.frontend: --migration-limit must be >= 0", file=sys.stderr)
        return 2
    try:
        settings = from_args(args)
    except ValueError as exc:
        print(f"syncd.engine.dynamo.frontend: {exc}", file=sys.stderr)
        return 2
    settings.apply()
    os.environ.pop("DYN_SYSTEM_PORT", None)  # the system port is a worker's; never bind it here

    async def run():
        from dynamo.llm import EngineType, EntrypointArgs, RouterConfig, RouterMode, make_engine, run_input
        from dynamo.runtime import DistributedRuntime

        loop = asyncio.get_running_loop()
        runtime = DistributedRuntime(loop, settings.discovery, settings.request_plane)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, runtime.shutdown)
        mode = {"round-robin": RouterMode.RoundRobin, "random": RouterMode.Random,
                "least-loaded": RouterMode.LeastLoaded}[args.router_mode]
        entry = EntrypointArgs(EngineType.Dynamic, http_host=args.http_host, http_port=args.http_port,
                               router_config=RouterConfig(mode), migration_limit=args.migration_limit,
                               namespace=settings.namespace)
        engine = await make_engine(runtime, entry)
        try:
            await run_input(runtime, "http", engine)
        except asyncio.CancelledError:
            pass

    import uvloop

    uvloop.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
