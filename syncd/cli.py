"""Moved to :mod:`syncd.app.cli` (the applications that wire syncd, engine and trainer together live in
``syncd.app``); kept until 0.3: each name imported from here warns (DeprecationWarning) with its new path.
``python -m syncd.cli`` still runs it, with a note on stderr."""

from syncd.lazy import lazy_names

__all__ = ["ENV", "build_parser", "main"]

__getattr__ = lazy_names(__name__, {n: "syncd.app.cli" for n in __all__}, deprecated=True)

if __name__ == "__main__":
    import sys

    from syncd.app.cli import main

    print("syncd.cli moved to syncd.app.cli: "
          "run `syncd` or `python -m syncd.app.cli` (syncd.cli goes in 0.3)", file=sys.stderr)
    sys.exit(main())
