"""matplotlib for the benchmarks' ``--plot`` PNGs: :func:`pyplot` (the Agg backend, no display needed) and
:func:`save` (the folder made, the figure closed). matplotlib is in the ``bench`` and ``test`` extras; without it
:func:`pyplot` raises ImportError naming the extra."""

from __future__ import annotations

from pathlib import Path

__all__ = ["pyplot", "save", "write_results"]


def pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover
        raise ImportError("--plot needs matplotlib (pip install 'syncd[bench]')") from exc
    return plt


def save(fig, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    fig.clf()
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def write_results(out: dict, json_path, plot_path, plot) -> None:
    """A benchmark's epilogue: ``out`` as JSON at ``json_path`` (folder made) and ``plot(out, Path)`` at
    ``plot_path``; either is skipped when its path is falsy."""
    import json

    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(out, indent=1))
    if plot_path:
        plot(out, Path(plot_path))
