"""Names a package imports on first use (so that importing it stays cheap: no torch until an op or an engine is
used): :func:`lazy_names` makes the package's module ``__getattr__`` (PEP 562) from a table; and
:func:`quiet_optional_imports`, the one place where the import-time warnings of optional torch extensions are held
back. Thread-safe (the import system's locks)."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys

__all__ = ["lazy_names", "quiet_optional_imports"]

#: loggers that speak while an optional extension loads: torchao's "Failed to load <its CUDA library>" on a
#: CPU-only torch (at its import)
_NOISY_AT_IMPORT = ("torchao",)


def _not_torchaos_enum_deprecation(record: logging.LogRecord) -> bool:
    """torch's pytree warns once per Enum that torchao registers (its KernelPreference, ScaleCalculationMode),
    whenever transformers loads those torchao modules; a deprecation aimed at torchao's code, not at ours."""
    return "is an Enum subclass and is now natively supported" not in str(record.msg)


def quiet_optional_imports() -> None:
    """Import torchao now, if it is installed, with its import-time warnings held back (its logger at ERROR
    during the import, as it was after), and drop torch's pytree deprecation about torchao's enums. transformers
    imports torchao lazily, at the first ``from_pretrained`` or ``from_config``, where its warnings would reach
    every engine and tool log; torchao is only a benchmark baseline and a test reference here. Call it before
    the first model is built; idempotent."""
    pytree = logging.getLogger("torch.utils._pytree")
    if _not_torchaos_enum_deprecation not in pytree.filters:
        pytree.addFilter(_not_torchaos_enum_deprecation)
    if "torchao" in sys.modules or importlib.util.find_spec("torchao") is None:
        return
    loggers = [logging.getLogger(n) for n in _NOISY_AT_IMPORT]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        importlib.import_module("torchao")
    except Exception:  # noqa: BLE001 -- a broken optional extension must not stop an engine; transformers says why
        pass
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


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
