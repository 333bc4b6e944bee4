"""Names a package imports on first use (so that importing it stays cheap: no torch until an op or an engine is
used): :func:`lazy_names` makes the package's module ``__getattr__`` (PEP 562) from a table. Thread-safe (the import
system's locks)."""

from __future__ import annotations

import importlib
import sys

__all__ = ["lazy_names"]


def lazy_names(package: str, table: dict):
    """The ``__getattr__`` of module ``package``: ``table`` maps each public name to the module it lives in (or to
    ``(module, attribute)``); the value is imported on first access and kept in the module. An unknown name raises
    ``AttributeError`` as for any module."""
    def __getattr__(name: str):
        try:
            target = table[name]
        except KeyError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        module, attr = target if isinstance(target, tuple) else (target, name)
        value = getattr(importlib.import_module(module), attr)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
