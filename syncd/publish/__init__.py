"""The store format's writer, next to its readers (``syncd.versions``, ``syncd.newest``,
``syncd.manifest_source``): a trainer's weights published as versions in object storage (``docs/layout.md``).

Modules, one concept each: ``publisher`` (:class:`WeightPublisher`, the background publisher a training loop
calls), ``shard_writer`` (:class:`ShardWriter`, one version's shards built and uploaded; :func:`delta_formats`, the
codec format of each tensor's deltas) and ``version_numbers`` (how the next version is numbered in a store that
others may have written). The trainer side imports the publisher as ``syncd.trainer.WeightPublisher``.

The names below are imported on first use (``publisher`` and ``shard_writer`` load torch).
"""

from __future__ import annotations

from syncd.lazy import lazy_names

_LAZY = {
    "WeightPublisher": "syncd.publish.publisher",
    "ShardWriter": "syncd.publish.shard_writer", "delta_formats": "syncd.publish.shard_writer",
}

__all__ = sorted(_LAZY)


__getattr__ = lazy_names("syncd.publish", _LAZY)
