"""``Update``: one version to stage or load, in the trainer's tensor names."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

__all__ = ["Update"]


@dataclass
class Update:
    """An update to stage, in the trainer's names.

    ``kind="delta"``: ``tensors`` maps trainer tensor names to codec blobs (``bytes``/``memoryview`` of
    format v1, ``docs/delta-format.md``) taking ``base_version`` to ``version``; tensors not named are
    unchanged. ``kind="full"``: ``tensors`` maps every trainer name to its full CPU tensor (``base_version``
    is ignored). ``checksums`` (trainer name -> ``syncd.ops.checksum`` of the full result tensor) lets the
    engine or controller verify. The engine may keep references to the buffers until ``apply`` returns.
    """

    version: int
    kind: str
    tensors: Mapping[str, object]
    base_version: int | None = None
    checksums: Mapping[str, int] = field(default_factory=dict)
