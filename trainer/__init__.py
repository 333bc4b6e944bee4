"""Trainer-side library of syncd: publishing weights, rewards, and numerics shared with the engines."""

from __future__ import annotations

import importlib

_LAZY = {
    "WeightPublisher": ("syncd.publish.publisher", "WeightPublisher"),
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'syncd.trainer' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value
