"""The two figures of a ComBo run: relevance heatmap (task × backbone) and accuracy bars per task."""

from __future__ import annotations

from typing import Any

import numpy as np


def relevance_heatmap(tasks: list[str], names: list[str], scores: np.ndarray, kept: dict[str, list[str]]) -> Any:
    """Relevance (Σ_l ‖W_{k,l}‖_F), each row divided by its maximum; the kept top-k framed."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    rel = scores / scores.max(axis=1, keepdims=True)
    fig = Figure(figsize=(1.6 + 1.3 * len(names), 0.9 + 0.5 * len(tasks)), layout="constrained")
    ax = fig.subplots()
    im = ax.imshow(rel, cmap="viridis", aspect="auto", vmin=float(rel.min()), vmax=1.0)
    for i, task in enumerate(tasks):
        for k, name in enumerate(names):
            ax.text(k, i, f"{scores[i, k]:.2f}", ha="center", va="center", fontsize=8,
                    color="black" if rel[i, k] > 0.5 * (1 + rel.min()) else "white")
            if name in kept.get(task, []):
                ax.add_patch(Rectangle((k - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="red", lw=2))
    ax.set_xticks(range(len(names)), names, rotation=20)
    ax.set_yticks(range(len(tasks)), tasks)
    ax.set_title("ComBo task relevance Σ_l‖W_k,l‖_F (colour: / row max; red: kept top-k)", fontsize=9)
    fig.colorbar(im, ax=ax, shrink=0.8)
    return fig


def accuracy_bars(tasks: list[str], columns: dict[str, list[float]]) -> Any:
    """Grouped bars: one group per task plus the mean, one bar per method column."""
    from matplotlib.figure import Figure

    groups = [*tasks, "mean"]
    fig = Figure(figsize=(1.5 + 1.2 * len(groups), 3.8), layout="constrained")
    ax = fig.subplots()
    width = 0.8 / max(len(columns), 1)
    for j, (label, accs) in enumerate(columns.items()):
        values = [*accs, float(np.mean(accs))]
        ax.bar(np.arange(len(groups)) + (j - (len(columns) - 1) / 2) * width, values, width, label=label)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel("test accuracy")
    lows = [min(a) for a in columns.values() if a]
    ax.set_ylim(max(0.0, min(lows, default=0.0) - 0.1), 1.0)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, ncol=min(len(columns), 5), loc="upper center", bbox_to_anchor=(0.5, -0.08))
    ax.set_title("Per-task test accuracy", fontsize=10)
    return fig
