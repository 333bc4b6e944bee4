"""Names a package imports on first use (so that importing it stays cheap: no torch until an op or an engine is
used): :func:`lazy_names` makes the package's module ``__getattr__`` (PEP 562) from a table; and the one place
where the import-time warnings of optional torch extensions are held back: importing this module (``import syncd``
does) puts filters on their loggers, so that torchao's "Failed to load <its CUDA library>" on a CPU-only torch and
torch's pytree deprecation about torchao's enums never reach a log, whoever imports torchao and whenever
(transformers does, lazily, at the first ``from_pretrained``); :func:`quiet_optional_imports` also imports torchao
at once. Only those messages are dropped: the loggers' other records pass. Thread-safe (the import system's locks;
adding a filter twice is a no-op)."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys

__all__ = ["lazy_names", "quiet_optional_imports"]

def _not_torchaos_enum_deprecation(record: logging.LogRecord) -> bool:
    """torch's pytree warns once per Enum that torchao registers (its KernelPreference, ScaleCalculationMode),
    whenever transformers loads those torchao modules; a deprecation aimed at torchao's code, not at ours."""
    return "is an Enum subclass and is now natively supported" not in str(record.msg)


def _not_a_missing_cuda_library(record: logging.LogRecord) -> bool:
    """torchao, at its import, logs one WARNING per CUDA extension it cannot load ("Failed to load
    <path>.so: ...") on a CPU-only torch: expected there, and said by every process that builds a model."""
    msg = str(record.msg)
    return not (msg.startswith("Failed to load") and ".so" in msg)


#: logger -> the filter that holds its import-time noise back
_FILTERS = {"torch.utils._pytree": _not_torchaos_enum_deprecation, "torchao": _not_a_missing_cuda_library}


def _hold_back_import_noise() -> None:
    for name, keep in _FILTERS.items():
        logger = logging.getLogger(name)
        if keep not in logger.filters:
            logger.addFilter(keep)


def quiet_optional_imports() -> None:
    """Import torchao now, if it is installed (the filters above hold its import-time warnings back). For code
    that wants the import done before the first model is built; idempotent."""
    _hold_back_import_noise()
    if "torchao" in sys.modules or importlib.util.find_spec("torchao") is None:
        return
    try:
        importlib.import_module("torchao")
    except Exception:  # noqa: BLE001 -- a broken optional extension must not stop an engine; transformers says why
        pass


_hold_back_import_noise()


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
