"""Moved to :mod:`syncd.app.rl_stack` (the applications that wire syncd, engine and trainer together live in
``syncd.app``); kept until 0.3: each name imported from here warns (DeprecationWarning) with its new path."""

from syncd.lazy import lazy_names

__all__ = ["RLStack", "StackConfig"]

__getattr__ = lazy_names(__name__, {n: "syncd.app.rl_stack" for n in __all__}, deprecated=True)
