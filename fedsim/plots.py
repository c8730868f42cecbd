"""Plots logged with every run (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from fedsim.engine.history import History  # noqa: E402


def plot_learning_curves(history: History, path: Path, title: str) -> Path:
    """Accuracy (left) and loss (right) per round, for every series the run recorded."""
    fig, (ax_acc, ax_loss) = plt.subplots(1, 2, figsize=(10, 4))
    keys = sorted({k for r in history.records for k in r.metrics})
    for key in keys:
        points = history.series(key)
        if not points:
            continue
        rounds, values = zip(*points)
        if key.endswith("accuracy"):
            ax_acc.plot(rounds, values, marker="o", label=key)
        elif key.endswith("loss"):
            ax_loss.plot(rounds, values, marker="o", label=key)
    for ax, name in ((ax_acc, "accuracy"), (ax_loss, "loss")):
        ax.set_xlabel("round")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    ax_acc.set_ylim(0, 1)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
