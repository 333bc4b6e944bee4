"""A real engine process (``python -m syncd.engine.control_server``, headless) whose weights a test can change behind
the daemon's back: SIGUSR1 flips the lowest bit of the first word of one parameter, in the process's own memory,
outside every control route -- what a memory fault or an engine bug would do. Test-only entry point.

    python -m tests.daemon._corruptible_engine --model DIR --headless [syncd.engine.control_server flags]
"""

from __future__ import annotations

import signal
import sys

import torch

import syncd.engine.control_server as server


def main() -> int:
    build = server._build_engine

    def corruptible(args):
        adapter, generator = build(args)

        def flip(*_):
            weights = adapter.state_dict()
            name = sorted(weights)[0]
            weights[name].view(-1).view(torch.int16)[0] ^= 1

        signal.signal(signal.SIGUSR1, flip)
        return adapter, generator

    server._build_engine = corruptible
    return server.main()


if __name__ == "__main__":
    sys.exit(main())
