"""matplotlib for the benchmarks' ``--plot`` PNGs: :func:`pyplot` (the Agg backend, no display needed) and
:func:`save` (the folder made, the figure closed). matplotlib is in the ``bench`` and ``test`` extras; without it
:func:`pyplot` raises ImportError naming the extra. Routines draw through these two and are called by the one
epilogue (``bench._report.finish``)."""

from __future__ import annotations

from pathlib import Path

from syncd.plotting import pyplot as _pyplot
from syncd.plotting import save_figure

__all__ = ["pyplot", "save"]


def pyplot():
    return _pyplot("--plot")


def save(fig, path, *, dpi: int = 110) -> Path:
    return save_figure(fig, path, dpi=dpi)
