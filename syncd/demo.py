"""Moved to :mod:`syncd.app.demo` (the applications that wire syncd, engine and trainer together live in
``syncd.app``); kept until 0.3: each name imported from here warns (DeprecationWarning) with its new path.
``python -m syncd.demo`` still runs it, with a note on stderr."""

from syncd.lazy import lazy_names

__all__ = ["build_parser", "main", "run_main"]

__getattr__ = lazy_names(__name__, {n: "syncd.app.demo" for n in __all__}, deprecated=True)

if __name__ == "__main__":
    import sys

    from syncd.app.demo import main

    print("syncd.demo moved to syncd.app.demo: "
          "run `syncd demo --weights-only` or `python -m syncd.app.demo` (syncd.demo goes in 0.3)", file=sys.stderr)
    sys.exit(main())
