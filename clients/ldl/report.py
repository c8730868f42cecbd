"""What an LDL run reports besides its round metrics: the set-up summary and node histogram, the run means of
the pseudo-label measures, and plots and a CSV of the test and pseudo-label measures per round."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from clients.ldl.measures import MEASURES, RANKS
from envs.ldl import LDLData, LDLSplit, NodeRows

if TYPE_CHECKING:
    from fedsim.contracts.history import History

__all__ = ["plots", "pseudo_means", "setup_artifacts", "setup_summary"]


def setup_summary(data: LDLData, split: LDLSplit, rows: list[NodeRows]) -> dict[str, Any]:
    """The data set's sizes, how spread its distributions are, and how many nodes hold labelled rows."""
    d = data.d
    entropy = float(-(d * np.log(np.maximum(d, 1e-12))).sum(1).mean() / np.log(d.shape[1]))
    return {"ldl.set": data.name, "ldl.num_labels": data.num_labels, "ldl.n_test": len(split.test),
            "ldl.n_labelled": len(split.labelled), "ldl.n_unlabelled": len(split.unlabelled),
            "ldl.normalised_entropy": round(entropy, 4), "ldl.mean_peak_mass": round(float(d.max(1).mean()), 4),
            "ldl.labelled_nodes": sum(len(r.labelled) > 0 for r in rows)}


def setup_artifacts(data: LDLData, rows: list[NodeRows], out_dir: Path) -> list[Path]:
    """A histogram of each node's unlabelled rows by peak label."""
    from envs.plots import plot_label_histogram

    c = data.num_labels
    hist = np.stack([np.bincount(data.peak[r.unlabelled], minlength=c) for r in rows])
    lab = [len(r.labelled) for r in rows]
    title = f"unlabelled rows per node by peak label (labelled rows per node: {lab})"
    return [plot_label_histogram(hist, out_dir / "ldl_nodes.png", title)]


def pseudo_means(history: History) -> dict[str, float] | None:
    """Run means (rounds 1..R) of the pseudo-label measures (``ldl/pseudo_*_mean``, finite ones only);
    None when no round measured them (e.g. under DP)."""
    rounds = [r for r in history.records if r.round >= 1 and "eval/pseudo_spearman" in r.metrics]
    if not rounds:
        return None
    metrics: dict[str, float] = {}
    for k in ("spearman", "kendall", "cosine", "intersection", "kl"):
        series = [r.metrics[f"eval/pseudo_{k}"] for r in rounds]
        metrics[f"ldl/pseudo_{k}_mean"] = float(np.mean(series))  # over rounds 1..R: the whole run's pseudo-labels
    return {k: v for k, v in metrics.items() if math.isfinite(v)}


def plots(history: History, out_dir: Path, title: str) -> list[Path]:
    """The test and pseudo-label measures per round, pseudo-label quality by measure, and their CSV."""
    from matplotlib.figure import Figure

    from fedsim.metrics.plots import save

    keys = [*MEASURES, *RANKS]
    fig = Figure(figsize=(14, 6.5), layout="constrained")
    for i, k in enumerate(keys):
        ax = fig.add_subplot(2, 4, i + 1)
        for prefix, label in (("eval/", "test"), ("eval/pseudo_", "pseudo-labels (unlabelled pool)")):
            pts = history.series(prefix + k)
            if pts:
                ax.plot(*zip(*pts), marker=".", label=label)
        ax.set_title(k)
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
        if i == 0:
            ax.legend(fontsize=7)
    fig.suptitle(title)
    files = [save(fig, out_dir / "ldl_measures.png")]
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.add_subplot()
    for k in ("spearman", "kendall", "cosine", "intersection"):
        pts = history.series(f"eval/pseudo_{k}")
        if pts:
            ax.plot(*zip(*pts), marker=".", label=k)
    ax.set_xlabel("round")
    ax.set_ylabel("pseudo-labels vs truth")
    ax.set_title(f"pseudo-label quality: rank (Spearman, Kendall) vs similarity (Cosine, Intersection)\n{title}",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    files.append(save(fig, out_dir / "ldl_pseudo.png"))
    table = out_dir / "ldl_rounds.csv"
    cols = [f"eval/{k}" for k in keys] + [f"eval/pseudo_{k}" for k in keys]
    lines = [",".join(["round", *cols])]
    for r in history.records:
        if "eval/kl" in r.metrics:
            lines.append(",".join([str(r.round), *(f"{r.metrics.get(c, float('nan')):.6g}" for c in cols)]))
    table.write_text("\n".join(lines) + "\n")
    files.append(table)
    return files
