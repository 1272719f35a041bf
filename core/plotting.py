"""matplotlib for files only: the evaluation's frame grids, the run report's plots and ``inspect-sde``'s figure are
PNGs written on a training node, which has no display."""

from __future__ import annotations

from pathlib import Path


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (imported on first use: matplotlib is slow to import)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path) -> Path:
    """Write ``fig`` to ``path`` (its folder created) and close it."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    pyplot().close(fig)
    return path
