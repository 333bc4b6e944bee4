"""Moved to :mod:`syncd.app.demo` (the applications that wire syncd, engine and trainer together live in
``syncd.app``); re-exported here, kept for one release. ``python -m syncd.demo`` still runs it."""

from syncd.app.demo import build_parser, main, run_main  # noqa: F401

__all__ = ["build_parser", "main", "run_main"]

if __name__ == "__main__":
    import sys

    sys.exit(main())
