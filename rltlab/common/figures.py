"""Saving figures: matplotlib on the headless Agg backend (a Jupyter kernel, which sets
MPLBACKEND, keeps its inline one), PNG + SVG written atomically."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import matplotlib

if "matplotlib.pyplot" not in sys.modules and not os.environ.get("MPLBACKEND"):
    matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

__all__ = ["plt", "save_figure"]


def save_figure(fig, out_dir: str | os.PathLike, stem: str) -> list[Path]:
    """Save fig as <out_dir>/<stem>.png (150 dpi) and .svg, close it, return both paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{stem}.png", out_dir / f"{stem}.svg"]
    fig.tight_layout()
    for path in paths:
        tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
        fig.savefig(tmp, dpi=150 if path.suffix == ".png" else None)
        os.replace(tmp, path)
    plt.close(fig)
    return paths
