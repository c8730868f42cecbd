"""Figures of a graph-domain-adaptation run (matplotlib ``Figure`` objects, saved with
:func:`fedsim.metrics.plots.save`)."""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
from matplotlib.figure import Figure

__all__ = ["plot_f1_rounds", "plot_class_f1"]


def plot_f1_rounds(rounds: Sequence[int], series: Mapping[str, Sequence[float]], marks: Mapping[str, int],
                   title: str) -> Figure:
    """F1 per round, one line per series; a dashed vertical line at each selected round."""
    fig = Figure(figsize=(8, 4.5))
    ax = fig.add_subplot(1, 1, 1)
    for name, values in series.items():
        ax.plot(rounds, values, marker="o", markersize=3, label=name)
    for i, (name, r) in enumerate(marks.items()):
        ax.axvline(r, linestyle="--", color=f"C{7 + i}", alpha=0.8, label=f"selected by {name} (round {r})")
    ax.set_xlabel("round")
    ax.set_ylabel("F1")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_class_f1(per_class: Mapping[str, Sequence[float]], sizes: Sequence[int], tail: Sequence[int],
                  title: str) -> Figure:
    """Target F1 per class (grouped bars, one group per class), the source training size under each
    class; tail classes marked with a star."""
    fig = Figure(figsize=(8, 4.5))
    ax = fig.add_subplot(1, 1, 1)
    c = len(sizes)
    width = 0.8 / max(len(per_class), 1)
    xs = np.arange(c)
    for i, (name, values) in enumerate(per_class.items()):
        ax.bar(xs + (i - (len(per_class) - 1) / 2) * width, values, width, label=name)
    ax.set_xticks(xs, [f"{k}{'*' if k in tail else ''}\nn={sizes[k]}" for k in range(c)])
    ax.set_xlabel("class (source training nodes; * = tail)")
    ax.set_ylabel("target F1")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig
