"""Plots logged with every run (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path

from fedsim.mpl import use_agg

use_agg()
import matplotlib.pyplot as plt  # noqa: E402

from fedsim.contracts.history import History  # noqa: E402


#: Series named in a learning-curve legend; the rest are drawn but only counted.
MAX_LEGEND = 12


def plot_learning_curves(history: History, path: Path, title: str) -> Path:
    """Accuracy (left) and loss (right) per round, for every series the run recorded."""
    # constrained layout: tight_layout gives up (with a warning) when a long run's legend is tall
    fig, (ax_acc, ax_loss) = plt.subplots(1, 2, figsize=(10, 4), layout="constrained")
    keys = sorted({k for r in history.records for k in r.metrics})
    for key in keys:
        points = history.series(key)
        if not points:
            continue
        rounds, values = zip(*points)
        marker = "o" if len(points) <= 50 else None  # a marker per round only where they stay apart
        if key.endswith("accuracy"):
            ax_acc.plot(rounds, values, marker=marker, label=key)
        elif key.endswith("loss"):
            ax_loss.plot(rounds, values, marker=marker, label=key)
    for ax, name in ((ax_acc, "accuracy"), (ax_loss, "loss")):
        ax.set_xlabel("round")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        if len(handles) > MAX_LEGEND:  # e.g. a TTA run's per-cycle series: list the first ones only
            ax.legend(handles[:MAX_LEGEND], labels[:MAX_LEGEND], fontsize=7,
                      title=f"+{len(handles) - MAX_LEGEND} more series", title_fontsize=7)
        elif handles:
            ax.legend(fontsize=8)
    ax_acc.set_ylim(0, 1)
    fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_claim(spec, results, out_dir: Path, title: str, references: dict[str, float] | None = None) -> list[Path]:
    """Metric per round (mean over seeds, band = ±1 std) per configuration; and metric vs ε.

    ``references`` (e.g. ``{"floor": 0.1, "ceiling": 0.68}``) are drawn as horizontal lines on the
    curves, so every method is seen between its floor and ceiling.
    """
    import math

    import numpy as np

    from fedsim.reproduce import label_of

    paths = []
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in results:
        if not r.curves:
            continue
        n = min(len(c) for c in r.curves)
        arr = np.asarray([c[:n] for c in r.curves])
        mean, std = arr.mean(0), arr.std(0)
        xs = np.arange(n)
        ax.plot(xs, mean, label=r.label)
        ax.fill_between(xs, mean - std, mean + std, alpha=0.15)
    styles = {"floor": ("dimgray", ":"), "ceiling": ("black", "--")}
    for role, value in (references or {}).items():
        if not math.isnan(value):
            color, style = styles.get(role, ("gray", "-."))
            ax.axhline(value, color=color, linestyle=style, linewidth=1.2, label=f"{role} ({value:.3g})")
    ax.set_xlabel("round")
    ax.set_ylabel(spec.metric)
    paths.append(_finish(fig, ax, title, out_dir / "curves.png", legend_size=7))
    if "eps" in spec.grid:
        others = [k for k in spec.grid if k != "eps"]
        groups: dict[str, list] = {}
        for r in results:
            if getattr(r, "role", ""):  # a reference configuration is outside the ε grid
                continue
            key = label_of({k: r.setting[k] for k in others}) or "all"
            groups.setdefault(key, []).append(r)
        fig, ax = plt.subplots(figsize=(7, 4.5))
        finite = [float(e) for e in spec.grid["eps"] if e is not None and not math.isinf(float(e))]
        inf_x = (max(finite) * 2) if finite else 1.0
        for key, rs in groups.items():
            pts = []
            for r in rs:
                e = r.setting["eps"]
                x = inf_x if e is None or math.isinf(float(e)) else float(e)
                m, s = r.mean_std(r.finals)
                pts.append((x, m, s))
            pts.sort()
            xs, ms, ss = zip(*pts)
            ax.errorbar(xs, ms, yerr=ss, marker="o", capsize=3, label=key)
        ax.set_xscale("log")
        ticks = sorted(set(finite)) + [inf_x]
        ax.set_xticks(ticks)
        ax.set_xticklabels([f"{t:g}" for t in ticks[:-1]] + ["∞"])
        ax.set_xlabel("target ε (∞ = no DP)")
        ax.set_ylabel(f"final {spec.metric}")
        paths.append(_finish(fig, ax, title, out_dir / "metric_vs_eps.png", legend_size=8))
    return paths


def _finish(fig, ax, title: str, path: Path, legend_size: int) -> Path:
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=legend_size)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
