"""matplotlib for the benchmarks' ``--plot`` PNGs: :func:`pyplot` (the Agg backend, no display needed) and
:func:`save` (the folder made, the figure closed). matplotlib is in the ``bench`` and ``test`` extras; without it
:func:`pyplot` raises ImportError naming the extra."""

from __future__ import annotations

from pathlib import Path

from syncd.plotting import pyplot as _pyplot
from syncd.plotting import save_figure

__all__ = ["pyplot", "save", "write_results"]


def pyplot():
    return _pyplot("--plot")


def save(fig, path, *, dpi: int = 110) -> Path:
    return save_figure(fig, path, dpi=dpi)


def write_results(out: dict, json_path, plot_path, plot) -> None:
    """A benchmark's epilogue: ``out`` as JSON at ``json_path`` (folder made) and ``plot(out, Path)`` at
    ``plot_path``; either is skipped when its path is falsy."""
    import json

    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(out, indent=1))
    if plot_path:
        plot(out, Path(plot_path))
