"""The per-sandbox OpenAI-compatible proxy in front of the Dynamo frontend (``engine.proxy.server``), which
records every trajectory's tokens and writes the records to the object store (``engine.proxy.record``).
``python -m engine.proxy --upstream URL --run-id RUN --sandbox-id ID`` runs one."""

from __future__ import annotations

from syncd.lazy import lazy_names

_LAZY = {"Proxy": "engine.proxy.server", "ProxyConfig": "engine.proxy.server",
         "TRAJECTORY_HEADER": "engine.proxy.server", "read_record": "engine.proxy.record",
         "list_records": "engine.proxy.record", "replay_tokens": "engine.proxy.record",
         "RecordError": "engine.proxy.record"}

__all__ = sorted(_LAZY)


__getattr__ = lazy_names("engine.proxy", _LAZY)
