"""Moved to :mod:`syncd.app.rl_stack` (the applications that wire syncd, engine and trainer together live in
``syncd.app``); re-exported here, kept for one release."""

from syncd.app.rl_stack import RLStack, StackConfig  # noqa: F401

__all__ = ["RLStack", "StackConfig"]
