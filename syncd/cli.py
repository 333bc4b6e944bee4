"""Moved to :mod:`syncd.app.cli` (the applications that wire syncd, engine and trainer together live in
``syncd.app``); re-exported here, kept for one release. ``python -m syncd.cli`` still runs it."""

from syncd.app.cli import ENV, build_parser, main  # noqa: F401

__all__ = ["ENV", "build_parser", "main"]

if __name__ == "__main__":
    import sys

    sys.exit(main())
