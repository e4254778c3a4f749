"""Report figures: PSNR-vs-frame drift curves, per-window bars, per-layer heatmaps.

Figures are built on ``matplotlib.figure.Figure`` with an explicit Agg canvas, never through
``pyplot``: nothing global changes (no backend switch, no figure registry), so nothing leaks
and a caller's own matplotlib setup is untouched. matplotlib is imported inside the functions,
so importing this module is cheap. Each function writes one PNG atomically (temporary file +
rename) and returns its path.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import Tensor

from calibrate.io import write_atomic

DPI = 120


def _new_figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=DPI)
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: str | os.PathLike) -> Path:
    fig.tight_layout()
    return write_atomic(path, lambda f: fig.savefig(f, format="png"))


def _series(values: Tensor | Sequence[float]) -> list[float]:
    return torch.as_tensor(values, dtype=torch.float64).flatten().tolist()


def plot_psnr_curves(
    curves: Mapping[str, Tensor | Sequence[float]], path: str | os.PathLike, title: str = "PSNR vs reference"
) -> Path:
    """One line per scheme of a per-frame PSNR series against the frame index (drift curves)."""
    if not curves:
        raise ValueError("plot_psnr_curves needs at least one curve")
    fig = _new_figure(7.0, 4.0)
    ax = fig.add_subplot()
    for name, values in curves.items():
        ys = _series(values)
        ax.plot(range(len(ys)), ys, label=name, linewidth=1.2)
    ax.set_xlabel("frame")
    ax.set_ylabel("PSNR (dB)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, path)


def plot_window_bars(
    values: Mapping[str, Mapping[str, float]],
    path: str | os.PathLike,
    ylabel: str,
    title: str | None = None,
) -> Path:
    """Grouped bars: one group per window (in first-seen order), one bar per scheme.

    A scheme without a value for a window (shorter rollout) simply has no bar there.
    """
    if not values:
        raise ValueError("plot_window_bars needs at least one scheme")
    windows: list[str] = []
    for per_window in values.values():
        windows += [w for w in per_window if w not in windows]
    fig = _new_figure(max(5.0, 1.2 * len(windows) + 2.0), 4.0)
    ax = fig.add_subplot()
    width = 0.8 / len(values)
    for i, (name, per_window) in enumerate(values.items()):
        xs = [j + (i - (len(values) - 1) / 2) * width for j, w in enumerate(windows) if w in per_window]
        ys = [float(per_window[w]) for w in windows if w in per_window]
        ax.bar(xs, ys, width=width, label=name)
    ax.set_xticks(range(len(windows)), windows)
    ax.set_xlabel("frame window")
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, path)


def plot_layer_heatmap(
    matrix: Mapping[str, Sequence[float] | Tensor], path: str | os.PathLike, title: str = "attention KL per layer"
) -> Path:
    """Schemes (rows) x layers (columns) heatmap with each value written in its cell."""
    if not matrix:
        raise ValueError("plot_layer_heatmap needs at least one scheme")
    rows = {name: _series(v) for name, v in matrix.items()}
    num_layers = {len(r) for r in rows.values()}
    if len(num_layers) != 1:
        raise ValueError(f"every scheme needs the same number of layers, got {sorted(num_layers)}")
    (n,) = num_layers
    data = [[v if math.isfinite(v) else float("nan") for v in r] for r in rows.values()]
    fig = _new_figure(max(4.0, 0.7 * n + 2.5), max(2.0, 0.45 * len(rows) + 1.5))
    ax = fig.add_subplot()
    image = ax.imshow(data, aspect="auto", cmap="viridis")
    fig.colorbar(image, ax=ax)
    finite = [v for r in data for v in r if math.isfinite(v)]
    mid = (max(finite) + min(finite)) / 2 if finite else 0.0
    for i, r in enumerate(data):
        for j, v in enumerate(r):
            ax.text(j, i, f"{v:.3g}", ha="center", va="center", fontsize=7, color="black" if v > mid else "white")
    ax.set_xticks(range(n), [str(j) for j in range(n)])
    ax.set_yticks(range(len(rows)), list(rows))
    ax.set_xlabel("layer")
    ax.set_title(title)
    return _save(fig, path)
