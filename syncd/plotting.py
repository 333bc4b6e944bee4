"""matplotlib for every PNG syncd draws (benchmarks' ``--plot``, the demo's timeline, the trainer's run picture):
:func:`pyplot` (the Agg backend: no display needed) and :func:`save_figure` (the folder made, the figure laid out,
written and closed). matplotlib is in the ``bench`` and ``test`` extras; without it :func:`pyplot` raises
ImportError naming ``what`` needs it and the extra."""

from __future__ import annotations

from pathlib import Path

__all__ = ["pyplot", "save_figure"]


def pyplot(what: str = "plotting"):
    """``matplotlib.pyplot`` on the Agg backend; ImportError ``"<what> needs matplotlib (...)"`` without it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover
        raise ImportError(f"{what} needs matplotlib (pip install 'syncd[bench]')") from exc
    return plt


def save_figure(fig, path, *, dpi: int = 110) -> Path:
    """Lay ``fig`` out, write it to ``path`` (its folder made) at ``dpi``, close it; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
