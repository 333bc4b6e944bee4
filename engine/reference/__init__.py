"""The reference engine: real generation on PyTorch + transformers (CPU, or GPU when there is one) that takes
weight updates while it serves. ``ReferenceEngine`` (``engine.reference.engine``); tiny models:
``python -m engine.reference.make_tiny --out DIR [--moe]``."""

from __future__ import annotations


def __getattr__(name: str):
    if name in ("ReferenceEngine", "EngineStats"):
        from engine.reference import engine as _engine

        return getattr(_engine, name)
    raise AttributeError(f"module 'engine.reference' has no attribute {name!r}")


__all__ = ["ReferenceEngine", "EngineStats"]
