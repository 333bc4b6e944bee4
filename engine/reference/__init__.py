"""The reference engine: real generation on PyTorch + transformers (CPU, or GPU when there is one) that takes
weight updates while it serves. ``ReferenceEngine`` (``syncd.engine.reference.engine``); tiny models:
``python -m syncd.engine.reference.make_tiny --out DIR [--moe]``."""

from __future__ import annotations

from syncd.lazy import lazy_names


__getattr__ = lazy_names("syncd.engine.reference", {"ReferenceEngine": "syncd.engine.reference.engine",
                                              "EngineStats": "syncd.engine.reference.engine"})

__all__ = ["ReferenceEngine", "EngineStats"]
