"""Moved to :mod:`syncd.app.rl_demo` (the applications that wire syncd, engine and trainer together live in
``syncd.app``); kept until 0.3: each name imported from here warns (DeprecationWarning) with its new path.
``python -m syncd.rl_demo`` still runs it, with a note on stderr."""

from syncd.lazy import lazy_names

__all__ = ["build_parser", "main", "run"]

__getattr__ = lazy_names(__name__, {n: "syncd.app.rl_demo" for n in __all__}, deprecated=True)

if __name__ == "__main__":
    import sys

    from syncd.app.rl_demo import main

    print("syncd.rl_demo moved to syncd.app.rl_demo: "
          "run `syncd demo` or `python -m syncd.app.rl_demo` (syncd.rl_demo goes in 0.3)", file=sys.stderr)
    sys.exit(main())
