"""The per-sandbox OpenAI-compatible proxy in front of the Dynamo frontend (``syncd.engine.proxy.server``), which
records every trajectory's tokens and writes the records to the object store (``syncd.engine.proxy.record``).
``python -m syncd.engine.proxy --upstream URL --run-id RUN --sandbox-id ID`` runs one."""

from __future__ import annotations

from syncd.lazy import lazy_names

_LAZY = {"Proxy": "syncd.engine.proxy.server", "ProxyConfig": "syncd.engine.proxy.server",
         "TRAJECTORY_HEADER": "syncd.engine.proxy.server", "read_record": "syncd.engine.proxy.record",
         "list_records": "syncd.engine.proxy.record", "replay_tokens": "syncd.engine.proxy.record",
         "RecordError": "syncd.engine.proxy.record"}

__all__ = sorted(_LAZY)


__getattr__ = lazy_names("syncd.engine.proxy", _LAZY)
