"""Moved to :mod:`syncd.app.rl_demo` (the applications that wire syncd, engine and trainer together live in
``syncd.app``); re-exported here, kept for one release. ``python -m syncd.rl_demo`` still runs it."""

from syncd.app.rl_demo import build_parser, main, run  # noqa: F401

__all__ = ["build_parser", "main", "run"]

if __name__ == "__main__":
    import sys

    sys.exit(main())
