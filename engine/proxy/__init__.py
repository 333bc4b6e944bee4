"""The per-sandbox OpenAI-compatible proxy in front of the Dynamo frontend (``engine.proxy.server``), which
records every trajectory's tokens and writes the records to the object store (``engine.proxy.record``).
``python -m engine.proxy --upstream URL --run-id RUN --sandbox-id ID`` runs one."""

from __future__ import annotations

import importlib

_LAZY = {"Proxy": "engine.proxy.server", "ProxyConfig": "engine.proxy.server",
         "TRAJECTORY_HEADER": "engine.proxy.server", "read_record": "engine.proxy.record",
         "list_records": "engine.proxy.record", "replay_tokens": "engine.proxy.record",
         "RecordError": "engine.proxy.record"}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    try:
        module = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'engine.proxy' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
