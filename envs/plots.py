"""Plot how labels are spread over clients (the output of ``FederatedData.label_histogram``).

Up to :data:`MAX_BARS` clients get a stacked horizontal bar chart (one bar per client, one colour
per class); more clients get a heatmap.  Figures are drawn on matplotlib's Agg canvas directly, so
no global pyplot state or display backend is touched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

#: Above this many clients the bar chart becomes unreadable and a heatmap is drawn instead.
MAX_BARS = 50


def _class_colours(num_classes: int) -> list:
    from matplotlib import colormaps

    cmap = colormaps["tab10" if num_classes <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(num_classes)]


def _bar_chart(hist: np.ndarray, names: Sequence[str], title: str) -> Figure:
    n_clients, n_classes = hist.shape
    fig = Figure(figsize=(9.0, max(3.0, 0.32 * n_clients + 1.6)), layout="constrained")
    ax = fig.add_subplot()
    rows = np.arange(n_clients)
    left = np.zeros(n_clients)
    for c, colour in enumerate(_class_colours(n_classes)):
        ax.barh(rows, hist[:, c], left=left, color=colour, label=names[c], edgecolor="white", linewidth=0.4)
        left += hist[:, c]
    ax.set_xlim(0, max(1.0, float(left.max())) * 1.03)
    ax.set_yticks(rows, [str(r) for r in rows])
    ax.set_ylim(n_clients - 0.5, -0.5)  # client 0 on top, no empty margin
    ax.set_ylabel("client")
    ax.set_xlabel("examples (train + test)")
    ax.set_title(title)
    ax.legend(title="class", loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False,
              ncols=1 if n_classes <= 20 else 2)
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    return fig


def _heatmap(hist: np.ndarray, names: Sequence[str], title: str) -> Figure:
    n_clients, n_classes = hist.shape
    fig = Figure(figsize=(max(6.0, 0.45 * n_classes + 3.0), min(16.0, max(5.0, 0.06 * n_clients + 2.5))),
                 layout="constrained")
    ax = fig.add_subplot()
    image = ax.imshow(hist, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_xticks(np.arange(n_classes), list(names), rotation=45 if n_classes > 10 else 0)
    ax.set_xlabel("class")
    ax.set_ylabel("client")
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label="examples (train + test)")
    return fig


def plot_label_histogram(
    hist: np.ndarray,
    path: str | Path,
    title: str = "Label distribution per client",
    class_names: Sequence[str] | None = None,
) -> Path:
    """Save a PNG of a (num_clients, num_classes) count matrix to ``path``; return the path."""
    hist = np.asarray(hist)
    if hist.ndim != 2 or hist.shape[0] == 0 or hist.shape[1] == 0:
        raise ValueError(f"hist must be a non-empty (num_clients, num_classes) array, got shape {hist.shape}")
    names = list(class_names) if class_names is not None else [str(c) for c in range(hist.shape[1])]
    if len(names) != hist.shape[1]:
        raise ValueError(f"class_names has {len(names)} names for {hist.shape[1]} classes")
    build = _bar_chart if hist.shape[0] <= MAX_BARS else _heatmap
    fig = build(hist, names, title)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(out, dpi=110, format="png")
    return out
